"""The README and docs/*.md are tested documentation: every ```python block runs as pasted.

Each page's python blocks run in order in one fresh interpreter (this one: the project's .venv),
sharing one namespace, so a later block may use an earlier block's names. They run in a
temporary folder with HF_HUB_OFFLINE=1 and the session's model cache ($WORKBENCH_CACHE); a page
whose code opens a session gets `tiny-sft` built first (the `tiny_sft_dir` fixture, which also
marks the test slow). A block that cannot run here (a GPU, a remote cluster, S3 credentials,
minutes of work) says so on its first line, `# not run: <reason>`, and is skipped.

The pages' shape is pinned too: the README within 200 lines, opening with a GRPO step of at most
15 lines that names every phase; every docs page linked from the README; every relative link
and image pointing at a file (and heading) that exists; test counts quoted only in
docs/tests.md's "How long the tests take".
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
NOT_RUN = "# not run:"
README_MAX_LINES = 200
STEP_MAX_LINES = 15
# Runnable code that names one of these opens a model session: its page runs with tiny-sft built.
OPENS_A_SESSION = re.compile(
    r"open_session|create_session|policy_model|evaluate_model|run_sft|\btrain\(|tiny-sft")
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,})(?P<info>[^`]*)$")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*(?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
TEST_FIGURE = re.compile(r"\b\d[\d,]* (?:passed|failed|deselected)\b")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a markdown page."""

    page: Path
    line: int  # 1-based line of the block's first code line in the page
    lang: str  # the fence's info word ("python", "bash", "" ...)
    code: str  # dedented by the fence's indent

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def not_run_reason(self) -> str | None:
        """The reason after `# not run:` on the first line, or None for a block that runs."""
        first = next((ln.strip() for ln in self.code.splitlines() if ln.strip()), "")
        return first[len(NOT_RUN):].strip() if first.startswith(NOT_RUN) else None


def code_blocks(page: Path) -> list[Block]:
    """The page's fenced blocks in order (fences may be indented, as inside a list item)."""
    blocks, lines, i = [], page.read_text().splitlines(), 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        indent, ticks = opened["indent"], opened["ticks"]
        close = re.compile(rf"^[ \t]*{ticks}`*[ \t]*$")
        end = next((j for j in range(i + 1, len(lines)) if close.match(lines[j])), len(lines))
        body = [ln[len(indent):] if ln.startswith(indent) else ln.lstrip()
                for ln in lines[i + 1:end]]
        lang = (opened["info"].split() or [""])[0].lower()
        blocks.append(Block(page, i + 2, lang, "\n".join(body) + "\n"))
        i = end + 1
    return blocks


def python_blocks(page: Path) -> list[Block]:
    return [b for b in code_blocks(page) if b.lang == "python"]


def runnable(page: Path) -> list[Block]:
    return [b for b in python_blocks(page) if b.not_run_reason is None]


def prose(page: Path, code_spans: bool = False) -> str:
    """The page without its fenced blocks (where a `#` line is no heading) and, unless
    code_spans, without its inline code spans (where a link is no link)."""
    lines, inside = [], False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            inside = not inside
            continue
        if not inside:
            lines.append(line if code_spans else re.sub(r"`+[^`]*`+", "", line))
    return "\n".join(lines)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    headings = re.finditer(r"^#{1,6} +(.+?) *#*$", prose(page, code_spans=True), re.M)
    return {slug(m[1]) for m in headings}


def sessions_pages() -> tuple[list[Path], list[Path]]:
    """Pages with runnable python: (those that open no session, those that do)."""
    pages = [p for p in PAGES if runnable(p)]
    opens = [p for p in pages if any(OPENS_A_SESSION.search(b.code) for b in runnable(p))]
    return [p for p in pages if p not in opens], opens


PLAIN_PAGES, SESSION_PAGES = sessions_pages()

RUNNER = """
import json, sys
namespace = {"__name__": "__main__"}
for block in json.load(open(sys.argv[1])):
    print(f"----- {block['where']}", flush=True)
    # blank lines in front, so a traceback names the page's own line numbers
    code = "\\n" * (block["line"] - 1) + block["code"]
    exec(compile(code, block["page"], "exec"), namespace)
"""


STEP_UPDATED = """
assert up.datums == 16, f"the README's step made no update: {up}"
after = tc.forward(datums, "importance_sampling").result()  # the same datums, new weights
assert after.loss < -1e-4 and after.metrics["kl_sampler_trainer"] > 1e-7, after
"""
"""Run after the README's blocks: its GRPO step updated the weights. Both groups of its batch
carry signal (16 datums), and on those datums the importance-sampling loss, 0 at the weights
that sampled them (ratio 1, advantages of mean 0), fell, as the sampler/trainer KL rose."""


def run_page(page: Path, tmp_path: Path, cache: Path) -> None:
    """Every runnable python block of the page, in order, in one fresh interpreter (the
    README's followed by STEP_UPDATED)."""
    blocks = [{"page": str(b.page), "line": b.line, "where": b.where, "code": b.code}
              for b in runnable(page)]
    if page == README:
        blocks.append({"page": __file__, "line": 1, "where": "STEP_UPDATED",
                       "code": STEP_UPDATED})
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    (tmp_path / "runner.py").write_text(RUNNER)
    env = dict(os.environ, HF_HUB_OFFLINE="1", WORKBENCH_CACHE=str(cache), MPLBACKEND="Agg")
    done = subprocess.run([sys.executable, "runner.py", "blocks.json"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (
        f"a python block of {page.relative_to(ROOT)} failed when pasted (exit "
        f"{done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")


# ---------------------------------------------------------------- the pages run


@pytest.mark.parametrize("page", PLAIN_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(page: Path, tmp_path: Path, workbench_cache: Path) -> None:
    run_page(page, tmp_path, workbench_cache)


@pytest.mark.parametrize("page", SESSION_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run_on_tiny_sft(page: Path, tmp_path: Path, workbench_cache: Path,
                                       tiny_sft_dir: Path) -> None:
    run_page(page, tmp_path, workbench_cache)


def test_blocks_not_run_say_why() -> None:
    for page in PAGES:
        for block in python_blocks(page):
            reason = block.not_run_reason
            assert reason is None or len(reason) >= 10, (
                f"{block.where}: `{NOT_RUN}` needs a reason (a GPU, a cluster, credentials, "
                f"minutes), got {reason!r}")


def test_the_block_parser_reads_indented_fences_and_reasons(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("text\n\n- item\n\n  ```python\n  x = 1\n  ```\n\n```python\n"
                    "# not run: needs a GPU for this\ny = 2\n```\n\n```bash\nls\n```\n")
    blocks = code_blocks(page)
    assert [(b.lang, b.line, b.code) for b in blocks] == [
        ("python", 6, "x = 1\n"), ("python", 10, "# not run: needs a GPU for this\ny = 2\n"),
        ("bash", 15, "ls\n")]
    assert [b.not_run_reason for b in blocks[:2]] == [None, "needs a GPU for this"]


# ---------------------------------------------------------------- the pages' shape


def test_readme_is_at_most_200_lines() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/"


def test_readme_opens_with_one_grpo_step_phase_by_phase() -> None:
    step = python_blocks(README)[0]
    lines = step.code.rstrip("\n").splitlines()
    assert step.not_run_reason is None, "the README's GRPO step must run"
    assert len(lines) <= STEP_MAX_LINES, f"{step.where}: {len(lines)} lines"
    for call in ("rollout(", "score(", "advantages(", "make_datums(", "evaluate("):
        assert call in step.code, f"{step.where}: the step has no {call}...)"
    assert "update(" in step.code or ("forward_backward(" in step.code
                                      and "optim_step(" in step.code), "the step has no update"


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {m["target"].split("#")[0] for m in LINK.finditer(prose(README))}
    missing = [p.name for p in DOCS if f"docs/{p.name}" not in linked]
    assert DOCS and not missing, f"docs pages not linked from README.md: {missing}"


def broken_links(page: Path) -> list[str]:
    """The relative links and images of a page whose file or heading does not exist."""
    broken = []
    for m in LINK.finditer(prose(page)):
        target = m["target"]
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_images_resolve(page: Path) -> None:
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_test_figures_are_quoted_once_in_the_tests_page() -> None:
    """Test counts and durations move with every change: one place holds them (docs/tests.md's
    "How long the tests take"), and the README links there instead of quoting them."""
    page = ROOT / "docs" / "tests.md"
    text = page.read_text()
    section = re.search(r"^## How long the tests take\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert section, "docs/tests.md has no '## How long the tests take' section"
    assert TEST_FIGURE.search(section[1]), "the section quotes no test counts"
    outside = TEST_FIGURE.findall(text[:section.start()] + text[section.end():])
    assert not outside, f"docs/tests.md quotes test figures outside that section: {outside}"
    for other in (README, *(d for d in DOCS if d != page)):
        found = TEST_FIGURE.findall(other.read_text())
        assert not found, f"{other.name} quotes test figures {found}: link docs/tests.md"
