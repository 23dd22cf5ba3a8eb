"""The README, docs/ and the benchmarks' results speak only of the software: no issue numbers or
seed documents a reader cannot follow, no words about how the work was organised (rounds,
sessions of work, lent machines, device time, what ran out). benchmarks/RESULTS.md's links and
pictures resolve, as the docs' do (tests/test_readme.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_readme import broken_links

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "benchmarks").glob("*.md"))]

FORBIDDEN: dict[str, re.Pattern[str]] = {
    "an issue number": re.compile(r"\bissues?[ -]?#?\d+", re.I),
    "a seed document": re.compile(r"\bseed[ _-]?0\d\d\b", re.I),
    "the shared fact sheet": re.compile(r"\bFACTS\b"),
    "a numbered round of work": re.compile(r"\brounds? \d+\b", re.I),
    "a lent or borrowed machine": re.compile(r"\b(lent|lend|borrow(ed)?)\b", re.I),
    "device time or the device tool": re.compile(r"\bdevice (time|tool)\b", re.I),
    "a session of work": re.compile(
        r"\b(this|first|second|third|fourth|fifth|last|next|previous|earlier) session\b", re.I),
    "what ran out": re.compile(r"\bran out\b(?! of memory)|\bbudget left\b", re.I),
    "a path of the workplace": re.compile(r"\bshared/gpu\b", re.I),
}
"""What a page may not say, by kind. `session` alone is a product word (a training session,
SessionSpec), and so is running out of memory."""


def findings(text: str) -> list[tuple[int, str, str]]:
    """(line, the words, their kind) of every FORBIDDEN match in `text`, in order."""
    return [(n, m[0], kind) for n, line in enumerate(text.splitlines(), start=1)
            for kind, pattern in FORBIDDEN.items() for m in pattern.finditer(line)]


def test_the_pages_speak_only_of_the_software() -> None:
    found = [f"{page.relative_to(ROOT)}:{n}: {words!r} ({kind})"
             for page in PAGES for n, words, kind in findings(page.read_text())]
    assert not found, ("words about how the work was organised, or references a reader cannot "
                       "follow:\n" + "\n".join(found))


def test_the_check_finds_each_kind_and_spares_the_products_words() -> None:
    text = ("As issue 16 asked (seed 003, FACTS), in round 2.\n"
            "The 2-GPU machine was not lent, and the device time ran out this session.\n"
            "Not run: shared/gpu/vllm_8b.py.\n"
            "A training session (SessionSpec) ran out of memory at G=16; the session's lane; "
            "seed 7, seeds 0-63, 2 refill rounds.\n")
    assert findings(text) == [
        (1, "issue 16", "an issue number"), (1, "seed 003", "a seed document"),
        (1, "FACTS", "the shared fact sheet"), (1, "round 2", "a numbered round of work"),
        (2, "lent", "a lent or borrowed machine"),
        (2, "device time", "device time or the device tool"),
        (2, "this session", "a session of work"), (2, "ran out", "what ran out"),
        (3, "shared/gpu", "a path of the workplace")]


@pytest.mark.parametrize("page", [RESULTS], ids=lambda p: str(p.relative_to(ROOT)))
def test_the_results_links_and_pictures_resolve(page: Path) -> None:
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"
