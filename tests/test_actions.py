"""Reply parsing: a table of cases per grammar, canonical formatting, and a never-raises fuzz."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.envs import DIRECTIONS, GRAMMARS, Action, format_action, parse_action

RIGHT, UP, LEFT, DOWN = range(4)

KEYWORD_CASES = [
    ("up", "move", UP),
    ("down", "move", DOWN),
    ("left", "move", LEFT),
    ("right", "move", RIGHT),
    ("stop", "stop", None),
    ("  UP \n", "move", UP),
    ("Left", "move", LEFT),
    ("Stop.", "stop", None),
    ("Action: right", "move", RIGHT),
    ("```\nup\n```", "move", UP),
    ("```text\ndown\n```", "move", DOWN),
    ("<action>up</action>", "move", UP),
    ("<action> Left </action>", "move", LEFT),
    ("I see a wall. <action>down</action>", "move", DOWN),
    ("<ACTION>stop</ACTION>", "stop", None),
    ("up down", "invalid", None),
    ("go up then left", "invalid", None),
    ("<action>up</action><action>down</action>", "invalid", None),
    ("", "invalid", None),
    ("   \n ", "invalid", None),
    ("go north", "invalid", None),
    ("upward", "invalid", None),
    ("u p", "invalid", None),
    ("('move', 1)", "invalid", None),
    ("<action></action>", "invalid", None),
]

TUPLE_CASES = [
    ("('move', 0)", "move", RIGHT),
    ("('move', 1)", "move", UP),
    ("('move', 2)", "move", LEFT),
    ("('move', 3)", "move", DOWN),
    ("('stop', 'stop')", "stop", None),
    ("( 'move' , 3 )", "move", DOWN),
    ("('move',1)", "move", UP),
    ('("move", 1)', "move", UP),
    ('("stop", "stop")', "stop", None),
    ("(move, 2)", "move", LEFT),
    ("  ('move', 0)\n", "move", RIGHT),
    ("```python\n('move', 0)\n```", "move", RIGHT),
    ("`('move', 3)`", "move", DOWN),
    ("Action: ('move', 1)", "move", UP),
    ("<answer>('move', 2)</answer>", "move", LEFT),
    ("<action>('stop', 'stop')</action>", "stop", None),
    ("I go ('move', 0) then ('move', 3)", "move", DOWN),  # VisGym takes the last tuple
    ("('move', 4)", "invalid", None),
    ("('move', -1)", "invalid", None),
    ("('move', 0.0)", "invalid", None),
    ("('move', True)", "invalid", None),
    ("('move', '0')", "invalid", None),
    ("('jump', 0)", "invalid", None),
    ("('stop', 'go')", "invalid", None),
    ("('move',)", "invalid", None),
    ("('move', 0, 1)", "invalid", None),
    ("(1, 2)", "invalid", None),
    ("move 0", "invalid", None),
    ("up", "invalid", None),
    ("('move', 0", "invalid", None),
    ("", "invalid", None),
    ("5", "invalid", None),
]


@pytest.mark.parametrize(("text", "kind", "direction"), KEYWORD_CASES)
def test_keyword_table(text: str, kind: str, direction: int | None) -> None:
    action = parse_action(text, "keyword")
    assert (action.kind, action.direction, action.raw) == (kind, direction, text)
    assert bool(action.error) == (kind == "invalid")


@pytest.mark.parametrize(("text", "kind", "direction"), TUPLE_CASES)
def test_tuple_table(text: str, kind: str, direction: int | None) -> None:
    action = parse_action(text, "tuple")
    assert (action.kind, action.direction, action.raw) == (kind, direction, text)
    assert bool(action.error) == (kind == "invalid")


def test_tuple_errors_use_visgym_texts() -> None:
    assert parse_action("('move', 4)", "tuple").error == (
        "The action 4 is not in the valid action space of move so nothing is executed.")
    assert parse_action("('jump', 0)", "tuple").error == (
        "The action name 'jump' is not recognized in the available action space.")
    assert parse_action("('move',)", "tuple").error.startswith("The action format is invalid.")
    assert parse_action("move 0", "tuple").error.startswith("Cannot parse action string 'move 0'")


def test_errors_are_reproducible() -> None:
    # ast's messages can carry memory addresses; feedback text must not
    first, second = parse_action("up", "tuple").error, parse_action("up", "tuple").error
    assert first == second and "0x" not in first


def test_keyword_errors_name_the_choices() -> None:
    for text in ("", "go north", "up down"):
        error = parse_action(text, "keyword").error
        assert all(word in error for word in ("up", "down", "left", "right", "stop"))


@pytest.mark.parametrize("grammar", sorted(GRAMMARS))
def test_format_round_trips(grammar: str) -> None:
    actions = [Action("move", d, "") for d in range(4)] + [Action("stop", None, "")]
    for action in actions:
        text = format_action(action, grammar)
        parsed = parse_action(text, grammar)
        assert (parsed.kind, parsed.direction) == (action.kind, action.direction)


def test_format_spellings() -> None:
    assert [format_action(Action("move", d, ""), "keyword") for d in range(4)] == list(DIRECTIONS)
    assert format_action(Action("stop", None, ""), "keyword") == "stop"
    assert format_action(Action("move", 0, ""), "tuple") == "('move', 0)"
    assert format_action(Action("stop", None, ""), "tuple") == "('stop', 'stop')"


def test_bad_grammar_and_invalid_format_raise() -> None:
    with pytest.raises(ValueError, match="grammar"):
        parse_action("up", "json")
    with pytest.raises(ValueError):
        format_action(parse_action("garbage", "keyword"), "keyword")


FRAGMENTS = st.sampled_from([
    "(", ")", "'", '"', ",", " ", "\n", "move", "stop", "0", "3", "9", "up", "LEFT", "```",
    "<action>", "</action>", "<answer>", "</answer>", "Action:", "\\", "((((", "0x", "[", "]",
])
REPLIES = st.one_of(st.text(max_size=300), st.lists(FRAGMENTS, max_size=40).map("".join))


@settings(max_examples=300, deadline=None)
@given(text=REPLIES, grammar=st.sampled_from(sorted(GRAMMARS)))
def test_parse_never_raises(text: str, grammar: str) -> None:
    action = parse_action(text, grammar)
    assert action.kind in ("move", "stop", "invalid")
    assert action.raw == text
    assert (action.direction is not None) == (action.kind == "move")
    assert action.valid == (action.error == "")
