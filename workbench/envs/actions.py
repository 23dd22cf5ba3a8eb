"""Parse a model's reply into one maze action, and write the canonical reply for an action.

Two grammars, chosen by name from `GRAMMARS` (one parser function each):

- ``"tuple"`` is VisGym's maze_2d format: ``('move', d)`` with d 0 right, 1 up, 2 left, 3 down,
  or ``('stop', 'stop')``. Like VisGym's interactor it strips code fences, backticks and
  ``Action:`` labels, quotes a bare first identifier (``(move, 0)``), and takes the LAST
  well-formed action tuple in the reply; the tuple is then checked the way VisGym's
  ``step`` checks it, with VisGym's error texts.
- ``"keyword"`` is the tiny-model format: the reply is exactly one word of
  up | down | left | right | stop (any case, surrounding whitespace, a trailing period, an
  ``Action:`` label, a code fence or one ``<action>...</action>`` tag allowed). Two action
  words, or any other words, make the reply invalid: a format reward then means something.

The tuple grammar reads the last ``<action>``/``<answer>`` tag when there is one (VisGym reads
``<answer>``); the keyword grammar reads the tag only when there is exactly one.
`parse_action` never raises for a string; an unparseable reply is ``Action(kind="invalid")``
whose ``error`` is the feedback text shown to the model.
"""

from __future__ import annotations

import ast
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass

DIRECTIONS: tuple[str, ...] = ("right", "up", "left", "down")
"""Direction names by VisGym's action index: 0 right, 1 up, 2 left, 3 down."""

ACTION_KINDS: tuple[str, ...] = ("move", "stop", "invalid")

MAX_CANDIDATES = 64
"""The tuple parser tries at most this many parenthesised spans, the last ones first."""

_ADDRESS_RE = re.compile(r" at 0x[0-9a-fA-F]+")
_TAG_RE = re.compile(r"<(action|answer)>(.*?)</\1>", re.IGNORECASE | re.DOTALL)
_FENCE_RE = re.compile(r"```[\w-]*")
_LABEL_RE = re.compile(r"\baction\s*:\s*", re.IGNORECASE)
_BARE_IDENT_RE = re.compile(r"^\(\s*([A-Za-z_]\w*)(\s*,)")
_WORD_RE = re.compile(r"[a-z]+")


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


def move(direction: int, raw: str = "") -> Action:
    """A move action in direction 0..3 (0 right, 1 up, 2 left, 3 down)."""
    if direction not in range(len(DIRECTIONS)):
        raise ValueError(f"direction must be in 0..3, got {direction!r}")
    return Action(kind="move", direction=direction, raw=raw)


def stop(raw: str = "") -> Action:
    """The stop action."""
    return Action(kind="stop", direction=None, raw=raw)


def invalid(raw: str, error: str) -> Action:
    """An invalid reply with the feedback text explaining why."""
    return Action(kind="invalid", direction=None, raw=raw, error=error)


def _strip_markup(text: str) -> str:
    """Drop code fences, backticks and ``Action:`` labels; collapse whitespace (as VisGym)."""
    text = _FENCE_RE.sub("", text).replace("`", "")
    text = _LABEL_RE.sub(" ", text)
    return re.sub(r"\s+", " ", text).strip()


def _last_tag_content(text: str) -> str:
    """Content of the last <action>/<answer> tag, or the whole text when there is none."""
    matches = _TAG_RE.findall(text)
    return matches[-1][1] if matches else text


def _balanced_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of every matched '(' ... ')' pair, sorted by start."""
    stack: list[int] = []
    spans: list[tuple[int, int]] = []
    for i, ch in enumerate(text):
        if ch == "(":
            stack.append(i)
        elif ch == ")" and stack:
            spans.append((stack.pop(), i + 1))
    return sorted(spans)


def _literal(text: str) -> object:
    """ast.literal_eval that returns an Exception instead of raising (and stays quiet)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ast.literal_eval(text)
    except Exception as exc:  # noqa: BLE001 - any failure is a parse error
        return exc


def _last_action_tuple(text: str) -> str | None:
    """The last '(name, ...)' span that literal_evals to a tuple with a str first element."""
    for start, end in reversed(_balanced_spans(text)[-MAX_CANDIDATES:]):
        candidate = _BARE_IDENT_RE.sub(r"('\1'\2", text[start:end], count=1)
        node = _literal(candidate)
        if isinstance(node, tuple) and node and isinstance(node[0], str):
            return candidate
    return None


def _check_tuple(node: object, raw: str) -> Action:
    """Validate a literal the way VisGym's maze_2d step() does, with its feedback texts."""
    if not isinstance(node, tuple) or len(node) != 2:
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
    body = _strip_markup(_last_tag_content(text))
    candidate = _last_action_tuple(body)
    node = _literal(candidate if candidate is not None else body)
    if isinstance(node, Exception):
        reason = _ADDRESS_RE.sub("", str(node))  # no memory addresses: feedback is reproducible
        return invalid(text, f"Cannot parse action string {body[:200]!r}: {reason} so the action "
                       "is invalid.")
    return _check_tuple(node, text)


def parse_keyword(text: str) -> Action:
    """Parse the keyword grammar: exactly one of up/down/left/right/stop, nothing else."""
    choices = ", ".join((*DIRECTIONS, "stop"))
    tags = _TAG_RE.findall(text)
    body = _strip_markup(tags[0][1] if len(tags) == 1 else text).lower().rstrip(".!").strip()
    words = _WORD_RE.findall(body)
    if body == "stop":
        return stop(text)
    if body in DIRECTIONS:
        return move(DIRECTIONS.index(body), text)
    if not body:
        return invalid(text, f"Empty reply. Reply with exactly one of: {choices}.")
    if len(tags) > 1 or sum(word in (*DIRECTIONS, "stop") for word in words) > 1:
        return invalid(text, f"Reply with exactly one action, not several: one of {choices}.")
    return invalid(text, f"Cannot parse {body[:40]!r}. Reply with exactly one of: {choices}.")


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
