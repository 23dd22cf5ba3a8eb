"""The CPU cost of the vLLM engine's glue at the seed's rollout shape: the environment, the
prompts and images sent each turn, the replies parsed, with generation free. vLLM is the test
suite's recording fake (tests/test_vllm_engine.py: replies of 8 fixed tokens, image pads
expanded), so what is timed is the workbench's own work per turn, on this machine's CPU.

    python benchmarks/vllm_glue.py            # 8 mazes x 8 samples, 15 turns, 9x9 at 25 px
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.test_vllm_engine import FakeVLLM, _fake_module  # noqa: E402
from workbench.envs import MazeConfig, eval_set  # noqa: E402
from workbench.model import LoraSettings, load_model  # noqa: E402
from workbench.model.pretrained import tiny_sft_path  # noqa: E402
from workbench.policy import SamplingParams, chat_format, encode_image  # noqa: E402
from workbench.policy.engine import EngineSettings  # noqa: E402
from workbench.rl import phases  # noqa: E402
from workbench.session import SessionSpec, create_session  # noqa: E402


def install_fake(lm: Any) -> None:
    """The fake vllm in sys.modules: 8 fixed reply tokens, image token counts cached by size."""
    fmt = chat_format(lm.processor)
    reply = lm.processor.tokenizer.encode("('move', 'up')", add_special_tokens=False)[:8]
    counts: dict[tuple[int, int], int] = {}

    def count(pil: Any) -> int:
        if pil.size not in counts:
            counts[pil.size] = encode_image(lm.processor, np.array(pil)).n_patches // fmt.merge**2
        return counts[pil.size]

    state = FakeVLLM(reply_ids=lambda call: reply, image_tokens=count, image_pad=fmt.image_pad)
    state.count_cache = lambda prompt: None  # type: ignore[method-assign]  # no cache model
    sys.modules.update(_fake_module(state))


def main() -> None:
    folder = str(tiny_sft_path())
    lm = load_model(folder)
    install_fake(lm)
    spec = SessionSpec(folder, LoraSettings(rank=8, alpha=16), workdir="/tmp/vllm-glue",
                       dtype="bfloat16", engine=EngineSettings("vllm"))
    session = create_session(spec)
    try:
        sampler = session.training_client.save_weights_and_get_sampling_client()
        config = MazeConfig(size=9, px_per_cell=25, grammar="tuple", max_turns=15,
                            reward="stop_on_goal", format_weight=0.2)
        states, params = eval_set(9, 8), SamplingParams(max_tokens=8, temperature=1.0)
        runs, turns = [], 0
        for r in range(4):  # the first warms up
            start = time.perf_counter()
            ro = phases.rollout(sampler, phases.Batch(config, states, 8, params, r))
            runs.append(time.perf_counter() - start)
            turns = sum(ep.turns for ep in ro.flat)
        timed = ", ".join(f"{s:.2f}" for s in runs[1:])
        print(f"vLLM engine glue, 8 mazes x 8 samples, {turns} turns, generation free: "
              f"median {statistics.median(runs[1:]):.2f} s of 3 ({timed})")
    finally:
        session.close()


if __name__ == "__main__":
    main()
