"""Parse a model's reply into one maze action, and write the canonical reply for an action.

Two grammars, chosen by name from `GRAMMARS` (one parser function each). Both take time linear in
the reply's length: tags, words and tuples are found with str methods and regexes whose
repetitions are bounded or possessive, and nothing is ``eval``-ed.

A tag is an opening ``<action>`` or ``<answer>`` (ASCII letters in any case) and the first closing
tag of the same name after it. VisGym reads ``<answer>``.

- ``"tuple"`` is VisGym's maze_2d format: ``('move', d)`` with d 0 right, 1 up, 2 left, 3 down,
  or ``('stop', 'stop')``. It reads the last tag when there is one (the last closing tag that has
  an opening tag of its name before it, from the nearest such opening tag), else the whole reply,
  and takes the LAST action tuple in that text, so code fences, backticks, ``Action:`` labels and
  other text around the tuple do not matter. Only the last `MAX_CANDIDATES` ``(`` are tried as
  the tuple's start. An action tuple is flat: ``(``, a name, a comma, at most four elements
  separated by commas, an optional trailing comma, ``)``, with any whitespace between. The name
  is a quoted string or a bare identifier (``(move, 0)`` reads as ``('move', 0)``); an element is
  a quoted string, True, False, None or a number (an optional sign, a digit, then at most 39
  letters, digits, ``_`` or ``.``; it must read as a Python int, float or complex literal); a
  quoted string (optionally ``u``-prefixed) holds at most 40 characters and no quote, backslash
  or line break. The tuple is then checked the way VisGym's ``step`` checks it, with VisGym's
  error texts.
- ``"keyword"`` is the tiny-model format: one word of up | down | left | right | stop in any
  case, optionally after ``Action:`` labels, wrapped in whitespace, backticks or code fences
  (a fence's language tag is the word right after three backticks), followed by periods or
  exclamation marks. The reply is exactly that, or holds exactly one tag whose content is
  exactly that, with any text around the tag. The reply is invalid when it holds two or more
  action words anywhere, inside or outside a tag (a word is a run of ASCII letters, so
  "upward" and "setup" are no action words but "up_down" is two); when it holds more than one
  tag; or when the part read is longer than `MAX_KEYWORD_CHARS` once surrounding whitespace is
  trimmed.

`parse_action` never raises for a string; an unparseable reply is ``Action(kind="invalid")``
whose ``error`` is the feedback text shown to the model. Feedback quotes at most `QUOTE_CHARS`
characters of the reply (then "...") and is never longer than `MAX_FEEDBACK_CHARS`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

DIRECTIONS: tuple[str, ...] = ("right", "up", "left", "down")
"""Direction names by VisGym's action index: 0 right, 1 up, 2 left, 3 down."""

ACTION_KINDS: tuple[str, ...] = ("move", "stop", "invalid")

ACTION_WORDS: tuple[str, ...] = (*DIRECTIONS, "stop")
"""The keyword grammar's words."""

TAG_NAMES: tuple[str, ...] = ("action", "answer")
"""Tags the parsers read: <action>...</action> and <answer>...</answer>, in any case."""

MAX_CANDIDATES = 64
"""The tuple parser tries at most this many '(' as an action tuple's start, the last ones first."""

MAX_KEYWORD_CHARS = 1000
"""A keyword reply (or its tag's content) longer than this, once trimmed, is invalid."""

QUOTE_CHARS = 60
"""Feedback quotes at most this many characters of a reply, then '...'."""

MAX_FEEDBACK_CHARS = 200
"""No feedback text is longer than this."""


_OPEN_TAG = {name: f"<{name}>".encode() for name in TAG_NAMES}
_CLOSE_TAG = {name: f"</{name}>".encode() for name in TAG_NAMES}

# A quoted string, a tuple's name, a number, a constant: each of bounded length, and every
# repetition possessive (`*+`, `{m,n}+`), so a failed try never backtracks into it.
_STR = r"""[uU]?(?:'[^'\\\r\n]{0,40}'|"[^"\\\r\n]{0,40}")"""
_NAME = rf"(?:{_STR}|[A-Za-z_]\w{{0,39}}+)"
_NUMBER = r"[+-]?\s*+\d[\w.]{0,39}+"
_CONSTANT = r"(?:True|False|None)(?!\w)"
_ELEMENT = rf"(?:{_STR}|{_NUMBER}|{_CONSTANT})"
# `.*` first, matched at one position: the engine backs off from the end to the last '(' that
# starts a tuple, so one match finds the LAST tuple, trying each '(' once.
_LAST_TUPLE_RE = re.compile(
    rf".*\(\s*+(?P<name>{_NAME})\s*+,\s*+"
    rf"(?:(?P<rest>{_ELEMENT}(?:\s*+,\s*+{_ELEMENT}){{0,3}}+)\s*+,?\s*+)?\)",
    re.DOTALL,
)
_ELEMENT_RE = re.compile(rf"(?P<str>{_STR})|(?P<number>{_NUMBER})|(?P<constant>{_CONSTANT})")
_CONSTANTS: dict[str, object] = {"True": True, "False": False, "None": None}

_MARKUP = r"(?:[\s`]++|(?<=```)[\w-]++|action\s*+:)*+"
_KEYWORD_RE = re.compile(rf"{_MARKUP}(?:(?P<word>{'|'.join(ACTION_WORDS)})[\s.!`]*+)?")
_FENCE_RE = re.compile(r"```[\w-]*")
_LABEL_RE = re.compile(r"\baction\s*:\s*", re.IGNORECASE)
_WORD_BYTES = bytes(c if 97 <= c <= 122 else 32 for c in range(256))
"""bytes.translate table for a folded reply: letters stay, every other byte becomes a space."""


@dataclass(frozen=True)
class Action:
    """One parsed reply."""

    kind: str
    """"move", "stop" or "invalid"."""
    direction: int | None
    """0 right, 1 up, 2 left, 3 down for a move; None otherwise."""
    raw: str
    """The reply text as the model wrote it."""
    error: str = ""
    """Why the reply is invalid (the feedback text); empty when valid."""

    @property
    def valid(self) -> bool:
        """True for a move or a stop."""
        return self.kind != "invalid"


@dataclass(frozen=True)
class Tag:
    """Where one tag sits in a reply: its content is reply[start:end]."""

    start: int
    """Index just after the opening tag."""
    end: int
    """Index of the closing tag."""
    after: int
    """Index just after the closing tag."""


def move(direction: int, raw: str = "") -> Action:
    """A move action in direction 0..3 (0 right, 1 up, 2 left, 3 down)."""
    if direction not in range(len(DIRECTIONS)):
        raise ValueError(f"direction must be in 0..3, got {direction!r}")
    return Action(kind="move", direction=direction, raw=raw)


def stop(raw: str = "") -> Action:
    """The stop action."""
    return Action(kind="stop", direction=None, raw=raw)


def invalid(raw: str, error: str) -> Action:
    """An invalid reply with the feedback text (cut to MAX_FEEDBACK_CHARS) explaining why."""
    if len(error) > MAX_FEEDBACK_CHARS:
        error = error[: MAX_FEEDBACK_CHARS - 3] + "..."
    return Action(kind="invalid", direction=None, raw=raw, error=error)


def _quote(text: str, limit: int = QUOTE_CHARS) -> str:
    """repr() of text, cut to about `limit` characters and ending in '...' when anything was cut."""
    shown = repr(text[:limit])
    if len(text) <= limit and len(shown) <= limit + 2:
        return shown
    return shown[: limit + 1] + "..."


def _preview(text: str) -> str:
    """The start of text as feedback quotes it: fences, backticks and labels dropped, whitespace
    collapsed (as VisGym), looking at no more than 4 * QUOTE_CHARS characters."""
    text = _FENCE_RE.sub("", text.lstrip()[: 4 * QUOTE_CHARS]).replace("`", "")
    return " ".join(_LABEL_RE.sub(" ", text).split())


def _folded(text: str) -> bytes:
    """text as one byte per character: ASCII letters lower-cased, other non-ASCII ones '?'.

    Indexes into it are indexes into text, and bytes.find on it is a fast case-insensitive
    search for ASCII needles such as tags.
    """
    return text.encode("ascii", "replace").lower()


def _next_tag(folded: bytes, pos: int = 0) -> Tag | None:
    """The first tag at or after pos, paired as re.findall would pair them.

    An opening tag whose name has no closing tag after it never pairs, nor does any later one of
    that name, so that name is dropped: a few forward searches, however many tags are unclosed.
    """
    names = list(TAG_NAMES)
    while names:
        found = [(folded.find(_OPEN_TAG[name], pos), name) for name in names]
        found = [(index, name) for index, name in found if index >= 0]
        if not found:
            return None
        index, name = min(found)
        start = index + len(_OPEN_TAG[name])
        end = folded.find(_CLOSE_TAG[name], start)
        if end >= 0:
            return Tag(start=start, end=end, after=end + len(_CLOSE_TAG[name]))
        names.remove(name)
    return None


def _last_tag(folded: bytes) -> Tag | None:
    """The last closing tag that has an opening tag of its name before it, from the nearest one."""
    tags = []
    for name in TAG_NAMES:
        end = folded.rfind(_CLOSE_TAG[name])
        index = folded.rfind(_OPEN_TAG[name], 0, max(end, 0))
        if end >= 0 and index >= 0:
            tags.append(Tag(start=index + len(_OPEN_TAG[name]), end=end,
                            after=end + len(_CLOSE_TAG[name])))
    return max(tags, key=lambda tag: tag.after, default=None)


def _candidates_start(text: str) -> int:
    """Index of the MAX_CANDIDATES-th last '(' in text, or 0 when there are fewer."""
    start = len(text)
    for _ in range(MAX_CANDIDATES):
        start = text.rfind("(", 0, start)
        if start < 0:
            return 0
    return start


def _number(token: str) -> int | float | complex | None:
    """The value of a Python number literal ('3', '- 1', '0x1f', '1.5', '2j'); None if malformed."""
    sign = -1 if token.startswith("-") else 1
    digits = token.lstrip("+-").strip()
    converters: list[Callable[[str], int | float | complex]] = [lambda s: int(s, 0)]
    if any(c in digits for c in ".eEjJ"):  # float("01") is 1.0, but 01 is no Python literal
        converters += [float, complex]
    for convert in converters:
        try:
            return sign * convert(digits)
        except ValueError:
            continue
    return None


def _element(match: re.Match[str]) -> object:
    """The value of one tuple element matched by _ELEMENT_RE (a string without its quotes)."""
    if match["str"] is not None:
        return match["str"].lstrip("uU")[1:-1]
    if match["number"] is not None:
        return _number(match["number"])
    return _CONSTANTS[match["constant"]]


def _unquote(name: str) -> str:
    """A tuple's first element as a string: quotes dropped, a bare identifier as it is."""
    return name.lstrip("uU")[1:-1] if name[-1] in "'\"" else name


def _tuple_error(raw: str, body: str, reason: str) -> Action:
    """Invalid, with VisGym's "Cannot parse action string" feedback quoting the start of body."""
    return invalid(raw, f"Cannot parse action string {_quote(_preview(body))}: {reason}, so the "
                   "action is invalid.")


def _check_tuple(node: tuple[object, ...], raw: str) -> Action:
    """Validate a tuple the way VisGym's maze_2d step() does, with its feedback texts."""
    if len(node) != 2:
        return invalid(raw, "The action format is invalid. The action should be a tuple of two "
                       "elements with the first element being the action name and the second "
                       "element being the action payload.")
    branch, payload = node
    if branch == "move":
        if isinstance(payload, int) and not isinstance(payload, bool) and 0 <= payload < 4:
            return move(payload, raw)
    elif branch == "stop":
        if payload == "stop":
            return stop(raw)
    else:
        return invalid(raw, f"The action name '{branch}' is not recognized in the available "
                       "action space.")
    return invalid(raw, f"The action {payload} is not in the valid action space of {branch} so "
                   "nothing is executed.")


def parse_tuple(text: str) -> Action:
    """Parse VisGym's tuple grammar: "('move', 0)" ... "('stop', 'stop')"; last tuple wins."""
    tag = _last_tag(_folded(text))
    body = text[tag.start:tag.end] if tag is not None else text
    found = _LAST_TUPLE_RE.match(body, _candidates_start(body))
    if found is None:
        return _tuple_error(text, body, "no ('move', d) or ('stop', 'stop') tuple found")
    matches = list(_ELEMENT_RE.finditer(found["rest"] or ""))
    elements = [_element(m) for m in matches]
    for m, value in zip(matches, elements):
        if m["number"] is not None and value is None:
            return _tuple_error(text, body, f"{m['number']!r} is not a number")
    return _check_tuple((_unquote(found["name"]), *elements), text)


def _several_action_words(folded: bytes) -> bool:
    """True when a folded reply holds two or more action words (runs of ASCII letters).

    Every byte but a letter becomes a space; then each word is looked for as ' word ', and once
    more from one byte after its first hit (two copies can share a space: ' up up ').
    """
    padded = b" " + folded.translate(_WORD_BYTES) + b" "
    seen = 0
    for word in ACTION_WORDS:
        token = f" {word} ".encode()
        first = padded.find(token)
        if first >= 0:
            seen += 1 if padded.find(token, first + 1) < 0 else 2
        if seen >= 2:
            return True
    return False


def parse_keyword(text: str) -> Action:
    """Parse the keyword grammar: exactly one of up/down/left/right/stop, nothing else."""
    choices = ", ".join(ACTION_WORDS)
    folded = _folded(text)
    if _several_action_words(folded):
        return invalid(text, f"Reply with exactly one action, not several: one of {choices}.")
    tag = _next_tag(folded)
    if tag is not None and _next_tag(folded, tag.after) is not None:
        return invalid(text, f"Use one <action>...</action> tag, not several, holding one of: "
                       f"{choices}.")
    body = (text[tag.start:tag.end] if tag is not None else text).strip()
    if len(body) > MAX_KEYWORD_CHARS:
        return invalid(text, f"Too long for one word ({len(body)} characters). Reply with "
                       f"exactly one of: {choices}.")
    found = _KEYWORD_RE.fullmatch(body.lower())
    if found is None:
        return invalid(text, f"Cannot parse {_quote(_preview(body).lower(), 40)}. Reply with "
                       f"exactly one of: {choices}.")
    if found["word"] is None:
        return invalid(text, f"Empty reply. Reply with exactly one of: {choices}.")
    word = found["word"]
    return stop(text) if word == "stop" else move(DIRECTIONS.index(word), text)


GRAMMARS: dict[str, Callable[[str], Action]] = {"tuple": parse_tuple, "keyword": parse_keyword}
"""Reply grammars by name: each turns a reply string into an Action."""


def parse_action(text: str, grammar: str) -> Action:
    """Parse one reply with the named grammar; never raises for a str (invalid Action instead)."""
    if grammar not in GRAMMARS:
        raise ValueError(f"grammar must be one of {sorted(GRAMMARS)}, got {grammar!r}")
    return GRAMMARS[grammar](str(text))


def _format_tuple(action: Action) -> str:
    """VisGym's spelling: "('move', 0)" or "('stop', 'stop')"."""
    return "('stop', 'stop')" if action.kind == "stop" else f"('move', {action.direction})"


def _format_keyword(action: Action) -> str:
    """The bare word: "right", "up", "left", "down" or "stop"."""
    return "stop" if action.kind == "stop" else DIRECTIONS[action.direction or 0]


FORMATTERS: dict[str, Callable[[Action], str]] = {
    "tuple": _format_tuple,
    "keyword": _format_keyword,
}
"""Canonical reply writers by grammar name (the inverse of GRAMMARS for valid actions)."""


def format_action(action: Action, grammar: str) -> str:
    """The canonical text a model should emit for a valid action in this grammar (SFT target)."""
    if grammar not in FORMATTERS:
        raise ValueError(f"grammar must be one of {sorted(FORMATTERS)}, got {grammar!r}")
    if not action.valid:
        raise ValueError("an invalid action has no canonical text")
    return FORMATTERS[grammar](action)
