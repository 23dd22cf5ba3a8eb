"""The notebooks: committed clean, run by papermill with their committed parameters (only
OUT_DIR passed) on a kernel of this environment, their recorded metrics asserted (each
notebook's last cell writes them with workbench.notebook_checks.record_metrics), their pictures kept
in the saved notebook, readable without a kernel (no widget repr as text); one run in a real
browser (JupyterLab + Debian's chromium driven by Playwright), and a saved notebook opened there
with no kernel.

The kernel is a kernelspec named workbench-test whose argv is this interpreter, written to a
temporary JUPYTER_PATH, so a clean clone needs nothing registered beforehand.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import nbformat
import pytest

from workbench.envs import eval_set, oracle_ceiling, shortest_path_lengths
from workbench.notebook_checks import read_recorded
from workbench.rl import FAILURE_REASONS
from workbench.serve.deploy import free_port

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
NAMES = ["00_quickstart", "01_mazes", "02_rollouts", "03_update", "04_train", "05_evaluate",
         "06_serve", "07_session_api"]
ARTIFACTS = ROOT / "runs" / "test-artifacts"


# ---------------------------------------------------------------- committed state


def _parameter_lines(cell) -> list[str]:
    return [line for line in cell.source.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_clean_and_has_its_parameters_cell(name: str) -> None:
    from papermill import inspect_notebook

    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    tagged = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, "exactly one cell tagged `parameters`"
    assert all(not c.outputs and c.execution_count is None for c in code), "strip outputs"
    inferred = set(inspect_notebook(str(NOTEBOOKS / f"{name}.ipynb")))
    assert len(inferred) == len(_parameter_lines(tagged[0])), "papermill cannot parse a line"
    assert "OUT_DIR" in inferred and (name == "01_mazes" or "RAY_ADDRESS" in inferred)
    if name != "01_mazes":  # a model: the recipe is chosen by parameters
        assert {"BASE_MODEL", "PRESET", "DEVICE", "OVERRIDES"} <= inferred
    assert "record_metrics(" in code[-1].source, "the last cell records the metrics"
    # cells of 15 lines or fewer; the parameters cell is one constant a line, up to 20
    long = [c.source.splitlines()[0] for c in code
            if len(c.source.splitlines()) > (20 if c in tagged else 15)]
    assert not long, f"cells too long: {long}"


def test_every_notebook_is_listed() -> None:
    assert sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb")) == NAMES


# ---------------------------------------------------------------- papermill runs


def run_notebook(name: str, kernel: str, out: Path, **parameters) -> dict:
    """Execute notebooks/<name>.ipynb into out/ with OUT_DIR=out (and only the `parameters`
    given: none for the default runs); its recorded metrics."""
    import papermill

    out.mkdir(parents=True, exist_ok=True)
    papermill.execute_notebook(
        str(NOTEBOOKS / f"{name}.ipynb"), str(out / f"{name}.ipynb"),
        parameters=parameters | {"OUT_DIR": str(out)}, kernel_name=kernel, cwd=str(out),
        progress_bar=False, execution_timeout=300)
    return read_recorded(out / "metrics.json")


VIEWERS = ("trajectory_player(", "group_view(", "step_inspector(", "token_view(")
PICTURES = VIEWERS + ("plot_", "episode_grid(", "plt.")


def picture_cells(executed: Path) -> list[tuple[str, set[str]]]:
    """(first line, output mimetypes) of every executed cell that shows a viewer or a plot."""
    nb = nbformat.read(executed, as_version=4)
    return [(c.source.splitlines()[0], {k for o in c.outputs for k in o.get("data", {})})
            for c in nb.cells if c.cell_type == "code"
            and any(p in c.source for p in PICTURES) and "import " not in c.source]


WIDGET = "application/vnd.jupyter.widget-view+json"


def widget_repr(text: str) -> bool:
    """Whether a text/plain is an ipywidgets repr (`VBox(children=(...`, `Output()`)."""
    import ipywidgets

    names = {n for n, v in vars(ipywidgets).items()
             if isinstance(v, type) and issubclass(v, ipywidgets.Widget)}
    return text.split("(", 1)[0] in names and "(" in text


def assert_widgets_read_without_a_kernel(executed: Path) -> None:
    """What a front end that cannot show a widget shows (an untrusted notebook in JupyterLab,
    nbconvert without widget state, GitHub): no output's text/plain is a widget's repr, and
    a viewer's widget output follows its picture and has one line saying what it shows."""
    nb = nbformat.read(executed, as_version=4)
    for cell in (c for c in nb.cells if c.cell_type == "code"):
        where = f"{executed.name}: {cell.source.splitlines()[0]!r}"
        data = [o.get("data", {}) for o in cell.outputs]
        for k, d in enumerate(data):
            text = d.get("text/plain", "")
            assert not widget_repr(text), f"{where}: {text!r}"
            if WIDGET in d and any(v in cell.source for v in VIEWERS):  # not a progress bar
                assert any("image/png" in e for e in data[:k]), f"{where}: no picture"
                assert "\n" not in text and "run the cell to" in text, f"{where}: {text!r}"


def assert_pictures_saved(executed: Path) -> None:
    """Every viewer and plot cell keeps an image/png in the saved notebook (a viewer also
    keeps its live widget), so a viewer without JavaScript still shows it; widgets read
    cleanly without a kernel (assert_widgets_read_without_a_kernel)."""
    cells = picture_cells(executed)
    assert cells, f"{executed.name} shows no picture"
    for first_line, mimetypes in cells:
        assert "image/png" in mimetypes, f"{executed.name}: no image/png from {first_line!r}"
    assert_widgets_read_without_a_kernel(executed)


def assert_html_shows_pictures_without_javascript(executed: Path, viewers: int) -> None:
    """nbconvert's HTML of the executed notebook, scripts removed, still holds a PNG for every
    picture cell; `viewers` of them are live widgets (a player, a group view, ...)."""
    import re

    from nbconvert import HTMLExporter

    body, _ = HTMLExporter().from_filename(str(executed))
    no_js = re.sub(r"<script.*?</script>", "", body, flags=re.S)
    images = re.findall(r'<img[^>]+src="data:image/png;base64,', no_js)
    cells = picture_cells(executed)
    assert sum(1 for _, mt in cells if WIDGET in mt) == viewers, "live viewers"
    assert len(images) >= len(cells), f"{len(images)} images for {len(cells)} picture cells"


# The default runs: each notebook with exactly its committed parameters (only OUT_DIR passed),
# from the pretrained tiny policy (tiny-sft), asserting real signal.


def test_00_quickstart(kernel: str, sft_model: str, tmp_path: Path) -> None:
    m = run_notebook("00_quickstart", kernel, tmp_path)
    assert m["steps"] == [1, 2, 3] and m["eval_steps"] == [0, 3]
    assert all(0.0 <= r <= 1.0 for r in m["reward_mean"] + m["success_rate"])
    assert any(0.0 < r < 1.0 for r in m["reward_mean"]), "no step had a group with signal"
    assert m["ceiling"] == m["oracle_ceiling"] == oracle_ceiling(eval_set(9, 16), 15, "reach_goal")
    assert all(1 <= s <= m["ceiling"] for s in m["eval_greedy_solved"])
    assert m["cluster"] == "in-process"
    assert_pictures_saved(tmp_path / "00_quickstart.ipynb")


def test_01_mazes(kernel: str, tmp_path: Path) -> None:
    m = run_notebook("01_mazes", kernel, tmp_path)
    states = eval_set(9, 64)
    budgets = [8, 12, 15, 20]
    assert m["ceilings"] == {rule: {str(b): oracle_ceiling(states, b, rule) for b in budgets}
                             for rule in ("reach_goal", "stop_on_goal")}
    for b in budgets:  # stopping on the goal takes one more turn than reaching it
        assert m["ceilings"]["stop_on_goal"][str(b)] <= m["ceilings"]["reach_goal"][str(b)]
    assert m["shortest_paths"] == shortest_path_lengths(states)
    assert m["baseline_solved"]["oracle"] == m["baseline_ceiling"] == oracle_ceiling(
        states, 15, "reach_goal")
    assert m["baseline_solved"]["random"] <= m["baseline_solved"]["random_open"] < m[
        "baseline_ceiling"]
    assert_pictures_saved(tmp_path / "01_mazes.ipynb")


def test_02_rollouts(kernel: str, sft_model: str, tmp_path: Path) -> None:
    m = run_notebook("02_rollouts", kernel, tmp_path)
    rewards, adv = m["rewards_P_G"], m["advantages_P_G"]
    assert len(rewards) == 2 and all(len(g) == 8 for g in rewards)
    flat = [len(set(g)) == 1 for g in rewards]
    assert m["zero_variance_groups"] == sum(flat) < 2, "no group with reward variance"
    for is_flat, a_G in zip(flat, adv):
        if is_flat:
            assert a_G == [0.0] * 8
        else:  # GRPO: mean 0, unbiased std 1 (up to the 1e-6 in the denominator)
            mean = sum(a_G) / 8
            std = math.sqrt(sum((a - mean) ** 2 for a in a_G) / 7)
            assert abs(mean) < 1e-9 and abs(std - 1.0) < 1e-4
    assert m["datums"] == sum(a != 0.0 for g in adv for a in g) > 0
    assert m["player_turns"] == m["turns_P_G"][0][0]
    assert_pictures_saved(tmp_path / "02_rollouts.ipynb")
    assert_html_shows_pictures_without_javascript(tmp_path / "02_rollouts.ipynb", viewers=2)


def test_02_rollouts_takes_the_seed_recipe_by_its_parameters(kernel: str, tiny_dir: Path,
                                                             tmp_path: Path) -> None:
    """PRESET="seed_gpu" with DEVICE and OVERRIDES: the same cells run the seed's recipe (LoRA 32,
    32-token replies) here on the CPU, with the transformers engine for vLLM and parity
    advantages since the random tiny model earns no reward: what a GPU run changes."""
    m = run_notebook("02_rollouts", kernel, tmp_path, BASE_MODEL=str(tiny_dir), PRESET="seed_gpu",
                     DEVICE="cpu", MAX_TURNS=2, SAMPLES_PER_MAZE=2, OVERRIDES=[
                         "model.dtype=float32", "engine.name=transformers",
                         "engine.compile_decode=false", "speed.compile_layers=false",
                         "algorithm.advantage=parity"])
    assert m["recipe"] == {"device": "cpu", "dtype": "float32", "engine": "transformers",
                           "lora_rank": 32, "max_tokens": 32}
    assert m["turns_P_G"] == [[2, 2], [2, 2]] and m["rewards_P_G"] == [[0.0, 0.0], [0.0, 0.0]]
    assert m["advantages_P_G"] == [[-1.0, 1.0], [-1.0, 1.0]] and m["datums"] == 4


def test_03_update(kernel: str, sft_model: str, tmp_path: Path) -> None:
    m = run_notebook("03_update", kernel, tmp_path)
    assert m["datums"] == 8 and m["tokens"] > 0
    assert m["max_abs_logprob_diff_before"] < 1e-4 and m["clip_fraction_before"] == 0.0
    assert m["grad_norm"] > 1e-4, "the update had no gradient"
    norms = m["module_grad_norms"]
    assert sum(v > 0.0 for v in norms.values()) > len(norms) // 2
    total = math.sqrt(sum(v * v for v in norms.values()))
    assert math.isclose(total, m["grad_norm"], rel_tol=1e-4, abs_tol=1e-7)
    assert abs(m["loss_before"]) < 1e-5, "on-policy, the PPO loss is minus the mean advantage: 0"
    assert m["loss_after"] < -1e-4, "the step did not raise the positive-advantage replies"
    # whether a ratio moved past the clip range depends on the tiny-sft bytes, which differ by
    # CPU vendor (tests/test_pretrained.py); that the step moved them is checked below
    assert 0.0 <= m["clip_fraction_after"] <= 1.0
    assert m["replay_exact"] and m["replay_replayed"] == m["replay_logged"]
    assert 1 <= m["replay_step"] <= 2  # the last recorded step that updated
    replayed = m["replay_replayed"]
    assert replayed["update/grad_norm"] > 0.0 and replayed["update/datums"] > 0
    assert m["replay_logged"]["update/loss"] == replayed["update/loss"]
    # the token view's episode: every reply token, on-policy ratios of 1 (CPU float32), moved after
    assert m["inspect_tokens"] == m["inspect_reply_tokens"] > 0
    assert m["inspect_ratio_dev_before"] < 1e-5 and m["inspect_ratio_dev_after"] > 1e-3
    assert_pictures_saved(tmp_path / "03_update.ipynb")


def test_04_train_kill_and_resume(kernel: str, sft_model: str, tmp_path: Path) -> None:
    m = run_notebook("04_train", kernel, tmp_path)
    assert m["return_code"] == -9, "the background run finished before it was killed"
    assert 2 <= m["last_step_at_kill"] < 4
    assert m["identical"], "resumed metrics differ from the uninterrupted run's"
    assert m["steps"] == [1, 2, 3, 4] and m["eval_steps"] == [0, 2, 4]
    assert all(s >= 1 for s in m["eval_greedy_solved"])
    assert m["checkpoints"] == ["global_step_0", "global_step_2", "global_step_4"]
    assert m["exports"] == ["global_step_4"]
    phases = {name: (seconds, count) for name, seconds, count in m["projection"]["phases"]}
    assert {name: count for name, (_, count) in phases.items()} == {  # 100 steps, intervals 2/2/4
        "rollout": 100, "weight_sync": 100, "update": 100, "step_rest": 100, "eval": 51,
        "checkpoint": 51, "export": 25}
    assert phases["rollout"][0] > 0 and phases["eval"][0] > 0 and phases["update"][0] >= 0
    assert m["projection"]["wall_s"] == pytest.approx(sum(s * c for s, c in phases.values()))
    assert_pictures_saved(tmp_path / "04_train.ipynb")


def test_05_evaluate(kernel: str, tiny_dir: Path, sft_model: str, tmp_path: Path) -> None:
    m = run_notebook("05_evaluate", kernel, tmp_path)
    ceiling = oracle_ceiling(eval_set(9, 64), 15, "reach_goal")
    assert m["ceiling"] == m["oracle_ceiling"] == ceiling
    assert set(m["solved"]) == {"base/greedy", "sft/greedy", "grpo/greedy"}
    for key, solved in m["solved"].items():
        policy = key.split("/")[0]
        reasons = m["failure_reasons"][policy]
        assert set(reasons) <= set(FAILURE_REASONS)
        assert sum(reasons.values()) == m["episodes"][key] - solved  # every failure has one
        assert solved <= ceiling
    # both trained policies beat the random base; whether the notebook's few GRPO steps beat SFT
    # depends on the tiny-sft bytes, which differ by CPU vendor (tests/test_pretrained.py)
    assert m["solved"]["base/greedy"] < min(m["solved"]["sft/greedy"], m["solved"]["grpo/greedy"])
    failed_grpo = m["episodes"]["grpo/greedy"] - m["solved"]["grpo/greedy"]
    assert m["gallery"] == min(8, failed_grpo)
    assert_pictures_saved(tmp_path / "05_evaluate.ipynb")


def test_06_serve(kernel: str, sft_model: str, tmp_path: Path) -> None:
    """Publish and promote a 1-step adapter, serve it in the kernel's process (127.0.0.1, a free
    port), play maze 0 through the endpoint: the same moves as the in-process greedy rollout, and
    the served log-probs of a reply are the trainer's (a 1-step adapter is too close to its base
    for the check to tell them apart: not_base is recorded, not asserted)."""
    pytest.importorskip("uvicorn")
    pytest.importorskip("openai")
    m = run_notebook("06_serve", kernel, tmp_path)
    assert m["models"] == ["sft", "sft:maze-nb", "sft:default"] and m["default"] == "maze-nb"
    assert m["step"] == 1 and m["cluster"] == "in-process" and m["same_as_in_process"]
    assert 1 <= m["turns"] == len(m["replies"]) == m["requests"] - 1 <= 15  # + the parity check
    parity = m["parity"]
    assert parity["matches"] and parity["max_diff"] <= 1e-4 and parity["tokens"] > 0
    assert_pictures_saved(tmp_path / "06_serve.ipynb")


def test_06_serve_on_local_ray(kernel: str, sft_model: str, tmp_path: Path,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    """RAY_ADDRESS="local": the same endpoint as a Ray Serve replica of a local Ray."""
    pytest.importorskip("ray.serve")
    pytest.importorskip("openai")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # no token written to ~/.ray
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    m = run_notebook("06_serve", kernel, tmp_path, RAY_ADDRESS="local")
    assert m["models"] == ["sft", "sft:maze-nb", "sft:default"] and m["cluster"] == "local"
    assert m["same_as_in_process"] and m["turns"] == m["requests"] - 1 and m["parity"]["matches"]


def test_07_session_api(kernel: str, sft_model: str, tmp_path: Path) -> None:
    m = run_notebook("07_session_api", kernel, tmp_path)
    assert m["iterations"] == [1, 2, 3] and m["logprob_gap"] < 1e-4
    assert all(0.0 <= r <= 1.0 for r in m["rewards"])
    assert sum(m["datums"]) > 0, "no iteration had a group with reward variance"
    updated = [n > 0 for n in m["datums"]]  # an iteration without datums updates nothing
    assert [s is not None for s in m["optimizer_steps"]] == updated
    assert [s for s in m["optimizer_steps"] if s is not None] == list(range(1, sum(updated) + 1))
    assert [loss is not None for loss in m["losses"]] == updated
    assert_pictures_saved(tmp_path / "07_session_api.ipynb")


def test_07_session_api_on_local_ray(kernel: str, sft_model: str, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """RAY_ADDRESS="local": the same loop on trainer and sampler actors of a local Ray."""
    pytest.importorskip("ray")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # no token written to ~/.ray
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    m = run_notebook("07_session_api", kernel, tmp_path, RAY_ADDRESS="local")
    assert m["cluster"] == "local" and m["iterations"] == [1, 2, 3]
    assert m["logprob_gap"] < 1e-4
    assert [s is not None for s in m["optimizer_steps"]] == [n > 0 for n in m["datums"]]


def test_07_session_api_through_the_session_server(kernel: str, sft_model: str, tmp_path: Path
                                                   ) -> None:
    """SESSION_URL: the same cells on a session server (`workbench.service`), every call
    through the official tinker SDK; the recomputed log-probs match the sampled ones."""
    pytest.importorskip("tinker")
    from workbench.model import LoraSettings
    from workbench.service import start
    from workbench.session import SessionSpec

    server = start(SessionSpec(model="tiny-sft", lora=LoraSettings(vision=True),  # BASE_MODEL's
                               workdir=str(tmp_path / "server")), log=lambda _: None)
    try:
        m = run_notebook("07_session_api", kernel, tmp_path / "notebook",
                         SESSION_URL=server.url, SESSION_KEY="tml-notebook")
        usage = [u for u in server.service.clients.values()]
    finally:
        server.stop()
    assert m["session"] == "RemoteSession" and m["iterations"] == [1, 2, 3]
    assert m["logprob_gap"] < 1e-4
    assert [s is not None for s in m["optimizer_steps"]] == [n > 0 for n in m["datums"]]
    [client] = usage
    assert client.ended == "finished by the client" and client.usage.sampled_tokens > 0


# ---------------------------------------------------------------- a real browser

CHROMIUM = "/usr/bin/chromium"


def _browser_missing() -> str:
    if not Path(CHROMIUM).exists():
        return f"{CHROMIUM} is missing (as root on Debian: apt-get install -y chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is missing (pip install -e '.[dev]')"
    return ""


def _wait_for_server(url: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "jupyter lab exited"
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)  # polling until the server answers
    raise TimeoutError(f"jupyter lab did not answer at {url}")


@contextmanager
def _jupyter_lab(root: Path, tmp_path: Path) -> Iterator[str]:
    """JupyterLab on 127.0.0.1 over `root` (its own config, settings and workspaces under
    tmp_path); yields the URL of `<root>/{}` with its token, to be formatted with a file."""
    settings = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false"}))
    port, token = free_port(), secrets.token_hex(16)
    env = os.environ | {"JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
                        "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip", "127.0.0.1",
         "--allow-root", f"--port={port}", f"--IdentityProvider.token={token}",
         f"--ServerApp.root_dir={root}",
         f"--LabApp.user_settings_dir={tmp_path / 'settings'}",
         f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}",
         "--LabApp.expose_app_in_browser=True"],  # window.jupyterapp: its kernel state
        env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "lab.log", "w"))
    try:
        _wait_for_server(f"http://127.0.0.1:{port}/api/status?token={token}", proc)
        yield f"http://127.0.0.1:{port}/lab/tree/{{}}?token={token}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture
def lab(kernel: str, tmp_path: Path, sft_model: str) -> Iterator[str]:
    """JupyterLab on 127.0.0.1 over a folder holding 02_rollouts with tiny parameters; its URL."""
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    if reason := _browser_missing():
        pytest.skip(reason)
    root = tmp_path / "lab"
    root.mkdir()
    nb = load_notebook_node(str(NOTEBOOKS / "02_rollouts.ipynb"))
    nb = parameterize_notebook(nb, {"OUT_DIR": str(tmp_path / "out")})  # its defaults
    nb.metadata["kernelspec"] = {"name": kernel, "display_name": "Python (workbench test)",
                                 "language": "python"}  # found at once: no kernel prompt
    nbformat.write(nb, root / "02_rollouts.ipynb")
    with _jupyter_lab(root, tmp_path) as url:
        yield url.format("02_rollouts.ipynb")


def _close_dialogs(page) -> list[str]:
    """Close JupyterLab's dialogs, topmost first (its accept button, else its last button):
    "Select Kernel", "Kernel Restarting", ... A dialog under another cannot be clicked, so the
    top one (last in the page) goes first. Returns each closed dialog's text, for the report."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    closed: list[str] = []
    dialogs = page.locator(".jp-Dialog")
    for _ in range(8):
        if dialogs.count() == 0:
            break
        top = dialogs.last
        text = " ".join(top.inner_text().split())[:160]
        accept = top.locator(".jp-Dialog-button.jp-mod-accept")
        button = accept.last if accept.count() else top.locator(".jp-Dialog-button").last
        try:
            button.click(timeout=5_000)
            closed.append(text)
        except PlaywrightTimeout:
            page.keyboard.press("Escape")
            closed.append(f"{text} (Escape)")
    return closed


_KERNEL_READY = """() => {
  const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const kernel = panel && panel.sessionContext && panel.sessionContext.session
    && panel.sessionContext.session.kernel;
  return !!kernel && kernel.connectionStatus === 'connected' && kernel.status === 'idle';
}"""
_KERNEL_STATE = """() => {
  const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const session = panel && panel.sessionContext && panel.sessionContext.session;
  const kernel = session && session.kernel;
  return `app ${!!window.jupyterapp}, widget ${panel && panel.title.label}, kernel `
    + (kernel ? `${kernel.name} ${kernel.status} ${kernel.connectionStatus}` : 'none');
}"""


def _run_all_cells(page, expect, attempts: int = 3) -> None:
    """Run every cell once the notebook's kernel is connected and idle, as JupyterLab's own
    state says (its app object, exposed to the page by `_jupyter_lab`), not its status bar: a
    kernel that shows idle before its websocket is ready drops the request, and a dialog may
    cover the menu (both seen on clean clones). The command runs through the app's command
    registry (Run > Run All Cells' own command; not awaited), again if the first cell has not
    started ([*] or [1]) 30 s later; a run that never starts fails with the kernel's state and
    the dialogs closed."""
    import re

    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    started = page.locator(".jp-CodeCell .jp-InputPrompt").first
    closed: list[str] = []
    for _ in range(attempts):
        closed += _close_dialogs(page)
        try:
            page.wait_for_function(_KERNEL_READY, timeout=120_000)
        except PlaywrightTimeout:
            raise AssertionError(f"the kernel never became ready: {page.evaluate(_KERNEL_STATE)}"
                                 f"; dialogs closed: {closed or 'none'}") from None
        page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
        try:
            expect(started).to_have_text(re.compile(r"\[(\*|\d+)\]"), timeout=30_000)
            return
        except AssertionError:  # a dropped run, or a dialog in front of it
            continue
    raise AssertionError(f"Run All Cells never started: {page.evaluate(_KERNEL_STATE)}; "
                         f"dialogs closed: {closed or 'none'}")


@contextmanager
def _browser_page(screenshot: str) -> Iterator:
    """A page of Debian's chromium (1400 x 1000); its full-page screenshot is kept as
    runs/test-artifacts/<screenshot>, whether the test passed or failed."""
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            yield page
        finally:
            page.screenshot(path=str(ARTIFACTS / screenshot), full_page=True)
            browser.close()


def test_trajectory_player_in_a_real_browser(lab: str) -> None:
    """Open 02_rollouts in JupyterLab, run all cells, see the player's image, move its slider
    with the keyboard and see the turn change; the screenshot is kept in runs/test-artifacts."""
    from playwright.sync_api import expect

    with _browser_page("browser_02_rollouts.png") as page:
        page.goto(lab)
        idle = page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']")
        expect(idle).to_be_visible(timeout=120_000)
        text = page.locator(".widget-html-content").filter(has_text="reply:").first
        for attempt in range(2):  # a kernel swapped under a running "Run All" drops it
            _run_all_cells(page, expect)
            try:
                expect(text).to_contain_text("turn 1 of", timeout=240_000)
                break
            except AssertionError:
                if attempt == 1:
                    raise
        image = page.locator("img.widget-image").first
        expect(image).to_be_visible()
        assert image.evaluate("img => img.naturalWidth") > 0, "the frame did not load"
        page.locator(".widget-slider .noUi-handle").first.focus()
        page.keyboard.press("ArrowRight")
        expect(text).to_contain_text("turn 2 of", timeout=30_000)
        expect(page.locator(".widget-readout").first).to_have_text("2")


@pytest.fixture
def saved_lab(kernel: str, tmp_path: Path) -> Iterator[str]:
    """JupyterLab over a saved notebook (executed by nbclient, then written as a download or a
    clone holds it: not trusted here) showing a trajectory player and a group view of scripted
    episodes (no model); its URL."""
    from nbclient import NotebookClient

    from workbench.envs import MazeConfig
    from workbench.envs.tasks import SCRIPTED
    from workbench.rl.rollout import episode_summary, play_scripted

    if reason := _browser_missing():
        pytest.skip(reason)
    groups = play_scripted(SCRIPTED["oracle"], MazeConfig(size=5, max_turns=6), eval_set(5, 1))
    records = [episode_summary(groups[0][0])] * 2
    cells = [f"from workbench.viz import group_view, trajectory_player\nrecords = {records!r}",
             "trajectory_player(records[0])", "group_view(records, [0.5, -0.5])"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(nb, kernel_name=kernel, timeout=60).execute()
    nb.metadata.pop("kernelspec", None)  # no kernel named: JupyterLab asks which, if any
    root = tmp_path / "lab"
    root.mkdir()
    nbformat.write(nb, root / "saved.ipynb")
    with _jupyter_lab(root, tmp_path) as url:
        yield url.format("saved.ipynb")


def test_saved_notebook_without_a_kernel_in_a_real_browser(saved_lab: str) -> None:
    """Open a saved notebook in JupyterLab with no kernel: each viewer shows its picture and
    its one line, no widget repr; the screenshot is kept in runs/test-artifacts."""
    from playwright.sync_api import expect

    with _browser_page("browser_saved_no_kernel.png") as page:
        page.goto(saved_lab)
        dialog = page.locator(".jp-Dialog")  # "Select Kernel"
        dialog.get_by_role("button", name="No Kernel", exact=True).click(timeout=120_000)
        expect(dialog).to_have_count(0)
        expect(page.locator(".jp-StatusBar-TextItem").filter(
            has_text="No Kernel")).to_have_count(1)
        lines = page.locator(".jp-OutputArea-output[data-mime-type='text/plain']")
        expect(lines.filter(has_text="trajectory player: maze")).to_have_count(1)
        expect(lines.filter(has_text="group view: 2 episodes")).to_have_count(1)
        images = page.locator(".jp-OutputArea-output[data-mime-type='image/png'] img")
        expect(images).to_have_count(2)
        assert all(img.evaluate("i => i.naturalWidth") > 0 for img in images.all())
        output = page.locator(".jp-OutputArea").last.inner_text()
        assert "run the cell to" in output and "VBox(" not in output
        expect(page.locator(".widget-slider")).to_have_count(0)  # no live widget
