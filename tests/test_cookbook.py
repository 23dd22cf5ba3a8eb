"""A recipe nobody here wrote runs unchanged against the session server: tinker-cookbook's
math_rl (its arithmetic environment: "x + y" problems made in code, so it needs no dataset and
no model hub), in a venv of its own (tests/cookbook_env.sh), on tiny-sft over HTTP.

The cookbook's other recipes cannot run here: they load Hugging Face datasets (sl_basic,
rl_basic, sl_loop, rl_loop, chat_sl on its default data, code_rl, ...), pick their renderer
from a hub model name (a local folder needs `renderer_name`, which those loops do not take), or
call outside graders and sandboxes. math_rl takes `model_name` as a folder (the tokenizer is
read from it, on the client) and `renderer_name=qwen3_vl_instruct`.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tinker", reason="needs the service extra")

from workbench.model import LoraSettings  # noqa: E402
from workbench.serve.engine import key_hash  # noqa: E402
from workbench.service import ServiceSettings, start  # noqa: E402
from workbench.session import SessionSpec  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / "tests" / ".cookbook-venv"
KEY = "tml-cookbook"


@pytest.fixture(scope="module")
def cookbook() -> Path:
    """The cookbook's python, its venv built once (tests/cookbook_env.sh)."""
    python = VENV / "bin" / "python"
    if not python.exists() or subprocess.run([python, "-c", "import tinker_cookbook"]
                                             ).returncode:
        done = subprocess.run(["bash", str(ROOT / "tests" / "cookbook_env.sh")],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return python


@pytest.fixture(scope="module")
def server(tiny_sft_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    # rank 32: the recipe's default lora_rank
    running = start(SessionSpec(model=str(tiny_sft_dir), lora=LoraSettings(rank=32),
                                workdir=str(tmp_path_factory.mktemp("cookbook-service"))),
                    ServiceSettings(api_key_sha256=key_hash(KEY)), log=lambda _: None)
    yield running
    running.stop()


def test_the_cookbooks_math_rl_recipe_trains_through_the_server(
        cookbook: Path, server: Any, tiny_sft_dir: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TINKER", "VIRTUAL_ENV"))}
    env |= {"TINKER_BASE_URL": server.url, "TINKER_API_KEY": KEY, "TINKER_TELEMETRY": "0",
            "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [cookbook, "-m", "tinker_cookbook.recipes.math_rl.train", f"model_name={tiny_sft_dir}",
         "renderer_name=qwen3_vl_instruct", "env=arithmetic", "group_size=4",
         "groups_per_batch=2", "max_tokens=5", "max_steps=2", "eval_every=0", "save_every=2",
         f"log_path={tmp_path / 'math_rl'}", "behavior_if_log_dir_exists=delete"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-5000:]
    assert "Training completed successfully" in out
    usage = [json.loads(line) for line in
             (Path(server.service.workdir) / "usage.jsonl").read_text().splitlines()]
    sampled = sum(u["sampled_tokens"] for u in usage)
    trained = sum(u["trained_tokens"] for u in usage)
    assert sampled >= 2 * 2 * 4 and trained > 0  # 2 steps of 2 groups of 4 replies, trained on
    [model_id] = {m.stem.replace("-train-", ":train:") for m in
                  (Path(server.service.workdir) / "models").glob("*.json")}
    saved = server.service.checkpoints(model_id)
    assert {c["checkpoint_id"] for c in saved} == {  # save_every=2, then the final save
        "weights/000002", "sampler_weights/000002", "weights/final", "sampler_weights/final"}
