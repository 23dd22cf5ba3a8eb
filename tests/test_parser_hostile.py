"""Hostile replies: both grammars parse in bounded time, never raise, and keep feedback short.

A reply must parse in bounded time, so these tests time parse_action, the one exception to
"tests don't time things". The bounds are generous (50 ms for a 1 MB reply, which
parses in under 10 ms) and a call over its bound is timed twice more, keeping the fastest, so a
loaded machine's stall does not fail them; the old quadratic parser took seconds on 80 KB.
The table at the top pins every accepted and rejected reply shape (docs/maze.md, "Reply shapes").
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator

import pytest

from workbench.envs import DIRECTIONS, GRAMMARS, Action, parse_action
from workbench.envs.actions import (
    ACTION_KINDS,
    ACTION_WORDS,
    MAX_FEEDBACK_CHARS,
    MAX_KEYWORD_CHARS,
    QUOTE_CHARS,
)

MB = 1 << 20
BOUND_S_PER_MB = 0.050
"""Per-call time bound: 50 ms for a 1 MB reply, proportionally less for a shorter one..."""
BOUND_FLOOR_S = 0.020
"""...but never under 20 ms."""
TOTAL_BUDGET_S = 10.0
"""All hostile replies under both grammars together (about 1 s on an idle machine)."""
HOSTILE_REPLIES = 3000
SEED = 7

# (reply, keyword grammar result, tuple grammar result); a result is a word of ACTION_WORDS
# or None for an invalid reply.
SHAPES: list[tuple[str, str | None, str | None]] = [
    ("up", "up", None),
    ("  Stop.\n", "stop", None),
    ("stop!", "stop", None),
    ("Action: `LEFT`", "left", None),
    ("Action: left", "left", None),
    ("<ANSWER>down</ANSWER>", "down", None),
    ("```text\ndown\n```", "down", None),
    ("<action>right</action>", "right", None),
    ("<ACTION>Down</ACTION>", "down", None),
    ("I see a wall. <answer>up</answer>", "up", None),
    ("up" + " " * 2 * MAX_KEYWORD_CHARS, "up", None),
    ("<action>up</action> down", None, None),
    ("I see a wall to the left. <action>down</action>", None, None),
    ("up down", None, None),
    ("up up", None, None),
    ("up_down", None, None),
    ("upward", None, None),
    ("setup: left", None, None),
    ("Setup done, upward is a wall. <action>left</action>", "left", None),
    ("<action>up</action><action>up</action>", None, None),
    ("<action>up</action><action></action>", None, None),
    ("<action>up", None, None),
    ("<action>up</answer>", None, None),
    ("<answer><action>down</action></answer>", None, None),
    ("`" * MAX_KEYWORD_CHARS + "up", None, None),
    ("```up", None, None),
    ("ｕｐ", None, None),
    ("\u200bup", None, None),
    ("\u200fup\u200f", None, None),
    ("", None, None),
    ("('move', 1)", None, "up"),
    ('("move", 3)', None, "down"),
    ("(move, 0)", None, "right"),
    ("( 'move' , 1 , )", None, "up"),
    ("(((('move', 3))))", None, "down"),
    ("```python\n('stop', 'stop')\n```", None, "stop"),
    ("( 'move' ,\n 2 , )", None, "left"),
    ("(u'move', 0x1)", None, "up"),
    ("Action: ('stop', 'stop')", None, "stop"),
    ("```python\n('move', 3)\n```", None, "down"),
    ("I go ('move', 0) then ('move', 2)", None, "left"),
    ("('move', 1) then ('move', up)", None, "up"),
    ("<answer>('move', 1)</answer> ('move', 2)", None, "up"),
    ("<answer><action>('move', 3)</action></answer>", None, "down"),
    ("(('move', 2))", None, "left"),
    ("(" * 500 + "('move', 1)" + ")" * 500, None, "up"),
    ("('move', 1)" + " (" * 10, None, "up"),
    ("('move', 4)", None, None),
    ("('move', -1)", None, None),
    ("('move', 1.0)", None, None),
    ("('move', 01)", None, None),
    ("('move', True)", None, None),
    ("('move', '1')", None, None),
    ("('move', (1))", None, None),
    ("('stop',)", None, None),
    ("(stop, stop)", None, None),
    ("('move', 0, 1)", None, None),
    ("('move', 1", None, None),
    ("move 1", None, None),
    ("（'move', 1）", None, None),
]


def _result(action: Action) -> str | None:
    """The word an action stands for ("up", ..., "stop"), or None when invalid."""
    if action.kind == "move":
        return DIRECTIONS[action.direction or 0]
    return "stop" if action.kind == "stop" else None


@pytest.mark.parametrize(("reply", "keyword", "tuple_"), SHAPES)
def test_reply_shapes(reply: str, keyword: str | None, tuple_: str | None) -> None:
    assert _result(parse_action(reply, "keyword")) == keyword
    assert _result(parse_action(reply, "tuple")) == tuple_


@pytest.mark.parametrize("reply", [
    "<action>up</action> down", "Left. <action>left</action>", "up. Up!",
    "stop <answer>stop</answer>", "<action>up</action>\n\nThen I will go right.",
])
def test_keyword_rejects_two_action_words_anywhere(reply: str) -> None:
    action = parse_action(reply, "keyword")
    assert action.kind == "invalid" and "not several" in action.error


def test_keyword_rejects_two_tags_and_too_long_bodies() -> None:
    assert "not several" in parse_action("<action>up</action><answer></answer>", "keyword").error
    long = parse_action("`" * (MAX_KEYWORD_CHARS + 1) + "up", "keyword")
    assert "Too long" in long.error


@pytest.mark.parametrize("grammar", sorted(GRAMMARS))
@pytest.mark.parametrize("reply", [
    "x" * 10_000,
    "no action here " * 70_000,
    "\U0001F600\u200f\u200b" * 5_000,
    "\ud800" * 500,
    "(" * 300 + "'" + "a" * 300,
    "('" + "n" * 40 + "', '" + "p" * 40 + "')",
    "('move', '" + "p" * 40 + "')",
])
def test_feedback_is_truncated(reply: str, grammar: str) -> None:
    error = parse_action(reply, grammar).error
    assert 0 < len(error) <= MAX_FEEDBACK_CHARS
    assert len(error) < len(reply) or len(reply) < MAX_FEEDBACK_CHARS


def test_feedback_quotes_the_start_of_a_long_reply() -> None:
    reply = "I think " + "very " * 100 + "hard"
    for grammar in GRAMMARS:
        error = parse_action(reply, grammar).error
        assert "'i think very" in error.lower() and "..." in error
        quoted = error[error.index("'"):error.index("...")]
        assert len(quoted) <= QUOTE_CHARS + 1


# ---------------------------------------------------------------- timing and invariants

def _bound_s(text: str) -> float:
    """The time one parse of text may take."""
    return max(BOUND_FLOOR_S, BOUND_S_PER_MB * len(text) / MB)


def _timed_parse(text: str, grammar: str) -> tuple[Action, float]:
    """Parse once and time it; a call over its bound is timed twice more and the fastest kept."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        action = parse_action(text, grammar)
        best = min(best, time.perf_counter() - start)
        if best <= _bound_s(text):
            break
    return action, best


def _ascii_words(text: str) -> list[str]:
    """Runs of ASCII letters, lower-cased: the keyword grammar's notion of a word."""
    words, run = [], []
    for ch in text + " ":
        if ch.isascii() and ch.isalpha():
            run.append(ch.lower())
        elif run:
            words.append("".join(run))
            run = []
    return words


def _check_invariants(text: str, grammar: str, action: Action) -> None:
    """What every parse must satisfy, however hostile the reply."""
    assert isinstance(action, Action) and action.kind in ACTION_KINDS
    assert action.raw == text
    assert (action.direction is not None) == (action.kind == "move")
    if action.valid:
        assert action.error == ""
    else:
        assert 0 < len(action.error) <= MAX_FEEDBACK_CHARS
    if action.valid and grammar == "keyword" and len(text) <= 20_000:
        assert sum(word in ACTION_WORDS for word in _ascii_words(text)) == 1
    if action.valid and grammar == "tuple":
        assert ("move" in text or "stop" in text) and ")" in text


RTL = ["\u200f", "\u202e", "\u2067", "\u061c", "\u202c"]
ZERO_WIDTH = ["\u200b", "\u200c", "\u200d", "\ufeff", "\u2060"]
EMOJI = ["\U0001F600", "\U0001F9ED", "\u2b06\ufe0f", "\U0001F44D\U0001F3FD",
         "\U0001F468\u200d\U0001F469"]
FULL_WIDTH = ["ｕｐ", "ＤＯＷＮ", "ｌｅｆｔ", "ｓｔｏｐ", "（", "）", "＜ａｃｔｉｏｎ＞", "，"]
ODD = ["\ud800", "\udfff", "\x00", "\r", "\t", "\u00a0", "\u3000", "İ", "\u212a", "ſ", "\u0301"]
UNICODE = RTL + ZERO_WIDTH + EMOJI + FULL_WIDTH + ODD
WORDS = ["up", "down", "left", "right", "stop", "UP", "Left", "sToP", "upward", "setup", "go",
         "north", "move", "action", "answer", "Action:", "0", "1", "3", "4", "-1", "0x1", "1.0",
         "True", "None", "'move'", '"stop"', "'", '"']
TAGS = ["<action>", "</action>", "<answer>", "</answer>", "<ACTION>", "</Answer>", "<action",
        "action>", "</", "<", ">", "<action/>", "< action>"]
TUPLES = ["('move', 0)", "('move', 1)", '("move", 2)', "(move, 3)", "('stop', 'stop')",
          "('stop',)", "('move',)", "('move', 4)", "('jump', 0)", "('move', 0, 1)",
          "( 'move' , 1 , )", "('move', 1.0)", "('move', True)", "('move', 0x1)", "('move', 01)",
          "('move'", "'move', 1)", "(('move', 1))", "('move', (1))", "(u'stop', 'stop')",
          "('mo\\'ve', 1)", "('move', 1e-5)", "('" + "m" * 50 + "', 1)", "('move', 1, 2, 3, 4, 5)"]
PUNCT = ["(", ")", "((", "))", ",", "`", "```", "```python\n", "\\", ".", "!", " ", "\n", ":",
         "[", "]", "{", "}", "  ", "\n\n"]
FRAGMENTS = WORDS + TAGS + TUPLES + PUNCT + UNICODE
OPENS = ["<action>", "<answer>", "<ACTION>", "<Answer>"]
CLOSES = ["</action>", "</answer>", "</ACTION>", "</Answer>"]


def _soup(rng: random.Random, size: int = 12) -> str:
    """A few random fragments of every kind."""
    return "".join(rng.choices(FRAGMENTS, k=rng.randint(0, size)))


def _core(rng: random.Random) -> str:
    """One action in either grammar's spelling, or a near miss."""
    return rng.choice([*ACTION_WORDS, *TUPLES, "Stop.", "`up`", "Action: left", _soup(rng, 3)])


def _nested_tags(rng: random.Random) -> str:
    """Tags nested up to 2,000 deep around an action, some never closed."""
    depth = rng.randint(1, 2000)
    opens = "".join(rng.choices(OPENS, k=depth))
    closes = "".join(rng.choices(CLOSES, k=rng.randint(0, depth)))
    return opens + _core(rng) + closes


def _nested_parens(rng: random.Random) -> str:
    """Parentheses nested up to 5,000 deep around a tuple, balanced or not."""
    depth = rng.randint(1, 5000)
    return "(" * depth + _core(rng) + ")" * rng.randint(0, depth) + _soup(rng, 4)


def _unclosed_tags(rng: random.Random) -> str:
    """Opening tags with text between them and no closing tag."""
    return "".join(rng.choice(OPENS) + _soup(rng, 4) for _ in range(rng.randint(1, 300)))


def _repeated_opens(rng: random.Random) -> str:
    """The same opening tag many times, then maybe an action and a closing tag."""
    reply = rng.choice(OPENS) * rng.randint(1, 20_000) + _core(rng)
    return reply + rng.choice(["", *CLOSES])


def _unicode(rng: random.Random) -> str:
    """An action with RTL marks, emoji, full-width letters and zero-width characters around it."""
    noise = "".join(rng.choices(UNICODE, k=rng.randint(0, 40)))
    cut = rng.randint(0, len(noise))
    return noise[:cut] + _core(rng) + noise[cut:]


def _several_actions(rng: random.Random) -> str:
    """Two or more actions, bare, tagged or as tuples, with text between."""
    parts = [_core(rng) for _ in range(rng.randint(2, 6))]
    parts = [rng.choice(OPENS) + p + rng.choice(CLOSES) if rng.random() < 0.3 else p for p in parts]
    return rng.choice([" ", "\n", ". ", " then ", ""]).join(parts)


def _tuple_junk(rng: random.Random) -> str:
    """A tuple with junk spliced into it, or long strings and many elements."""
    tuple_ = rng.choice(TUPLES)
    cut = rng.randint(0, len(tuple_))
    return tuple_[:cut] + _soup(rng, 3) + tuple_[cut:] + rng.choice(["", _soup(rng, 6)])


def _soup_reply(rng: random.Random) -> str:
    """Fragments of every kind, a few hundred of them at most."""
    return _soup(rng, 300)


SHAPERS: list[Callable[[random.Random], str]] = [
    _nested_tags, _nested_parens, _unclosed_tags, _repeated_opens, _unicode, _several_actions,
    _tuple_junk, _soup_reply,
]


def _huge(rng: random.Random) -> str:
    """A hostile reply repeated to 64 KB .. 1 MB, maybe ending in a well-formed action."""
    block = rng.choice(SHAPERS)(rng) or "("
    size = rng.choice([64 * 1024, 256 * 1024, MB])
    return (block * (size // len(block) + 1))[:size] + rng.choice(["", "up", "('move', 1)"])


def hostile_replies(count: int, seed: int = SEED) -> Iterator[tuple[str, str]]:
    """(shape name, reply) for `count` hostile replies; one in 60 is huge (64 KB .. 1 MB)."""
    rng = random.Random(seed)
    for index in range(count):
        shaper = _huge if index % 60 == 59 else SHAPERS[index % len(SHAPERS)]
        yield shaper.__name__, shaper(rng)


FLOODS = {
    "'<action>' * 10000": "<action>" * 10_000,
    "1 MB of '<action>'": "<action>" * (MB // 8),
    "1 MB of '<action>up</action>'": "<action>up</action>" * (MB // 19),
    "1 MB of '('": "(" * MB,
    "1 MB of \"('move', \"": "('move', " * (MB // 9),
    "1 MB of \"('move', 1) \"": "('move', 1) " * (MB // 12),
    "1 MB of 'a '": "a " * (MB // 2),
    "1 MB of '`'": "`" * MB,
    "1 MB of whitespace, then up": " " * MB + "up",
    "1 MB of unicode": "\u200f\U0001F600ｕｐ\u200b" * (MB // 5),
    "10 KB of nested tuples": "(" * 64 + "1, " * 3_000 + ")" * 64,
}


@pytest.mark.parametrize("grammar", sorted(GRAMMARS))
@pytest.mark.parametrize("name", sorted(FLOODS))
def test_known_slow_replies_are_fast(name: str, grammar: str) -> None:
    text = FLOODS[name]
    action, seconds = _timed_parse(text, grammar)
    _check_invariants(text, grammar, action)
    assert seconds <= _bound_s(text), f"{name}: {seconds * 1000:.1f} ms under {grammar}"


def test_hostile_replies_parse_in_bounded_time_and_never_raise() -> None:
    total, shapes = 0.0, set()
    for shape, text in hostile_replies(HOSTILE_REPLIES):
        shapes.add(shape)
        for grammar in GRAMMARS:
            action, seconds = _timed_parse(text, grammar)
            where = f"{shape} under {grammar}: {text[:80]!r} ({len(text)} chars)"
            _check_invariants(text, grammar, action)
            assert seconds <= _bound_s(text), f"{seconds * 1000:.1f} ms for {where}"
            total += seconds
    assert shapes == {shaper.__name__ for shaper in [*SHAPERS, _huge]}
    assert total <= TOTAL_BUDGET_S, f"{total:.2f} s for {HOSTILE_REPLIES} replies"


REASONING = ["I", "see", "a", "wall", "to", "the", "north", "so", "going", "upward", "is", "out",
             "setup", "done", "\U0001F9ED", "\u200f", "\u200b", "ｕｐ", "ＬＥＦＴ", "\u00a0", "?"]
KEYWORD_BEFORE = ["", " ", "\n", "\u3000", "\t", "Action: ", "action:", "ACTION :\n", "```\n",
                  "```text\n", "`", "\n\n```plain-text\n"]
KEYWORD_AFTER = ["", ".", "!", "...", "\n", "`", "\n```", " \u00a0", ". \n"]


def _any_case(rng: random.Random, word: str) -> str:
    """word with each letter upper- or lower-cased at random."""
    return "".join(c.upper() if rng.random() < 0.5 else c for c in word)


def _reasoning(rng: random.Random) -> str:
    """Free text with no action word and no tag in it."""
    return " ".join(rng.choices(REASONING, k=rng.randint(0, 12)))


def _keyword_reply(rng: random.Random, word: str) -> str:
    """A well-formed keyword reply for word: markup around it, maybe a tag and reasoning."""
    core = rng.choice(KEYWORD_BEFORE) + _any_case(rng, word) + rng.choice(KEYWORD_AFTER)
    if rng.random() < 0.5:
        return core
    name = _any_case(rng, rng.choice(["action", "answer"]))
    return f"{_reasoning(rng)} <{name}>{core}</{name}>{rng.choice(['', ' ', _reasoning(rng)])}"


def _tuple_reply(rng: random.Random, word: str) -> str:
    """A well-formed tuple reply for word, with other tuples before it or outside its tag."""
    quote = rng.choice(["'", '"'])
    name = "move" if word in DIRECTIONS else "stop"
    name = rng.choice([f"{quote}{name}{quote}", f"u{quote}{name}{quote}", name])
    if word in DIRECTIONS:
        d = DIRECTIONS.index(word)
        payload = rng.choice([str(d), f"+{d}", f"+ {d}", hex(d), bin(d), oct(d)])
    else:
        payload = rng.choice(["'stop'", '"stop"', "u'stop'"])
    gaps = rng.choices(["", " ", "  ", "\n", "\t", "\n    "], k=4)
    tuple_ = f"({gaps[0]}{name}{gaps[1]},{gaps[2]}{payload}{gaps[3]}{rng.choice(['', ','])})"
    before = rng.choice(["", "Action: ", "```python\n", "`", "I go ('move', 9) then "])
    reply = before + tuple_ + rng.choice(["", "`", "\n```", " (done)", " :) ("])
    if rng.random() < 0.4:
        tag = _any_case(rng, rng.choice(["answer", "action"]))
        reply = f"{_reasoning(rng)} ('move', 2) <{tag}>{reply}</{tag}> ('stop', 'stop')"
    return reply


@pytest.mark.parametrize("grammar", sorted(GRAMMARS))
def test_decorated_replies_parse_to_their_action(grammar: str) -> None:
    rng = random.Random(SEED)
    write = _keyword_reply if grammar == "keyword" else _tuple_reply
    for _ in range(1500):
        word = rng.choice(ACTION_WORDS)
        reply = write(rng, word)
        assert _result(parse_action(reply, grammar)) == word, reply


def test_hostile_replies_are_reproducible_and_varied() -> None:
    first = list(hostile_replies(200))
    assert first == list(hostile_replies(200))
    assert len({text for _, text in first}) > 150
    kinds = {parse_action(text, grammar).kind for _, text in first for grammar in GRAMMARS}
    assert kinds == set(ACTION_KINDS)
