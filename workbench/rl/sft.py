"""SFT baseline: cross-entropy on oracle (BFS) trajectories, the checkpoint GRPO starts from.

Each example is a whole multi-turn episode rendered exactly as a rollout would render it
(system rules; per turn the image, feedback and budget; the oracle's reply), with loss on the
reply tokens only. The mazes are training mazes (`envs.train_maze`): never a task of the eval
set.

    python -m workbench sft sft.steps=300
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from workbench.envs import InitState, MazeConfig, MazeEnv, init_maze, system_prompt, train_states
from workbench.policy import ChatFormat, Stream, append_reply, chat_format, start_stream
from workbench.rl.rollout import SCRIPTED, observe
from workbench.session.losses import LossConfig
from workbench.session.types import AdamParams, Datum, per_reply

SFT_INDEX_OFFSET = 50_000_000  # SFT mazes: training indices far from the GRPO ones


def scripted_stream(processor: Any, fmt: ChatFormat, config: MazeConfig, state: InitState,
                    policy: str = "oracle", seed: int = 0) -> Stream:
    """The token stream of one scripted episode (replies tokenised, then <|im_end|>)."""
    return _play_scripted_stream(processor, fmt, config, state, policy, 0.0, seed)[0]


def _play_scripted_stream(processor: Any, fmt: ChatFormat, config: MazeConfig, state: InitState,
                          policy: str, noise: float, seed: int) -> tuple[Stream, list[bool]]:
    """Play `policy`, replacing a turn by a random move (walls included) with probability
    `noise`; returns the stream and, per reply, whether it was the policy's own (trainable)
    move."""
    rng = np.random.default_rng(seed)
    env = MazeEnv(config)
    obs, info = env.reset(options={"init_state": state})
    stream = observe(start_stream(processor, fmt, system_prompt(config)), processor, fmt, obs,
                     info, config)
    maze, own = init_maze(state), []
    while True:
        detour = noise > 0 and rng.random() < noise
        reply = SCRIPTED["random" if detour else policy](maze, env.pos, config, rng)
        own.append(not detour)
        tokens = processor.tokenizer.encode(reply, add_special_tokens=False) + [fmt.im_end]
        stream = append_reply(stream, fmt, tokens, [0.0] * len(tokens))
        obs, _, _, _, info = env.step(reply)
        if env.done:
            return stream, own
        stream = observe(stream, processor, fmt, obs, info, config)


def oracle_datum(processor: Any, fmt: ChatFormat, config: MazeConfig, state: InitState,
                 noise: float = 0.0, seed: int = 0) -> Datum:
    """An SFT datum: oracle replies weighted 1; random detours (probability `noise`, moves into
    walls included) are in context but weighted 0, so the model also sees the wall feedback and
    the oracle's way back from a wrong square (a noisy-expert, DART-style recipe)."""
    stream, own = _play_scripted_stream(processor, fmt, config, state, "oracle", noise, seed)
    return Datum(stream, (0.0,) * len(stream), per_reply(stream, own))


@dataclass(frozen=True)
class SFTStep:
    """Metrics of one SFT step."""

    step: int
    loss: float  # mean cross-entropy per reply token
    tokens: int
    grad_norm: float
    seconds: float


def sft_steps(training_client, config: MazeConfig, first_maze: int, steps: int,
              batch: int, adam: AdamParams, noise: float = 0.0,
              schedule: str = "constant") -> Iterator[SFTStep]:
    """Yield after each SFT step (a notebook can plot the loss as it goes); step s trains on
    training mazes first_maze + (s - 1) * batch, ... (`envs.train_states`) at `sft_lr(adam,
    schedule, s, steps)`. The next step's episodes are played while this step trains."""
    processor = training_client.get_processor()
    fmt = chat_format(processor)
    loss_cfg = LossConfig(reduction="token_mean")

    def datums(step: int) -> list[Datum]:
        states = train_states(config.size, first_maze + (step - 1) * batch, batch)
        return [oracle_datum(processor, fmt, config, s, noise, s.maze_seed) for s in states]

    ready = datums(1)
    for step in range(1, steps + 1):
        start = time.perf_counter()
        fb = training_client.forward_backward(ready, "cross_entropy", loss_cfg)
        opt = training_client.optim_step(sft_lr(adam, schedule, step, steps))
        ready = datums(step + 1) if step < steps else []
        out = fb.result()
        yield SFTStep(step, out.loss, out.metrics["tokens"], opt.result().grad_norm,
                      time.perf_counter() - start)


def sft_lr(adam: AdamParams, schedule: str, step: int, steps: int) -> AdamParams:
    """The optimiser settings of a 1-based SFT step: `adam` as it is (constant), or its learning
    rate times a cosine from 1 at step 1 to 0 after the last (cosine)."""
    if schedule == "constant":
        return adam
    return replace(adam, learning_rate=adam.learning_rate * 0.5 * (
        1.0 + math.cos(math.pi * (step - 1) / steps)))


def run_sft(config: Any, log: Any = print) -> Path:
    """SFT from config (model, env, generator.max_turns, sft.*) into run_dir; returns the
    exported model folder (`<run_dir>/model`) that GRPO loads as its base. A run_dir that is
    not empty is refused (storage.RunFolderExists) unless sft.overwrite, which lists what is
    removed in one line, then removes it."""
    import shutil

    from workbench import run as rundir
    from workbench import storage
    from workbench.config import ConfigError, check_loggers, to_dict
    from workbench.opener import check_model, open_session, session_spec

    check_model(config.model.name)
    check_loggers(config.trainer.logger)
    if storage.is_s3(config.run_dir):
        raise ConfigError(f"run_dir={config.run_dir}: sft writes a local folder, not s3://")
    run_dir = Path(config.run_dir)
    held = storage.run_contents(storage.open_store(run_dir)) if run_dir.is_dir() else ""
    storage.clear_or_refuse(str(run_dir), held, config.sft.overwrite, "sft.overwrite", (
        f"run_dir {run_dir} is not empty ({held}) and sft would delete it: add "
        "sft.overwrite=true to remove it, or choose another run_dir"),
        lambda: shutil.rmtree(run_dir), log)
    run_dir.mkdir(parents=True, exist_ok=True)
    rundir.write_json(run_dir / "config.json", to_dict(config))
    spec = session_spec(config, run_dir, full_finetune=config.sft.full_finetune)
    # SFT samples nothing: a Ray session gets trainer workers only
    session = open_session(replace(spec, cluster=replace(spec.cluster, num_engines=0)), log)
    adam = AdamParams(learning_rate=config.sft.learning_rate)
    first_maze = SFT_INDEX_OFFSET + config.trainer.seed * 100_000_000
    from tqdm.auto import tqdm

    steps = sft_steps(session.training_client, config.maze, first_maze, config.sft.steps,
                      config.sft.batch_size, adam, config.sft.noise, config.sft.lr_schedule)
    log = tqdm.write if log is print else log
    start, done = time.perf_counter(), 0
    for st in tqdm(steps, total=config.sft.steps, desc="SFT steps", leave=False, disable=None):
        done = st.step
        rundir.append_metrics(run_dir, {"step": st.step, "sft/loss": st.loss,
                                        "sft/tokens": st.tokens, "sft/grad_norm": st.grad_norm,
                                        "time/step": st.seconds},
                               config.trainer.logger)
        if st.step % 25 == 0 or st.step == config.sft.steps:
            log(f"sft step {st.step:>4}  loss {st.loss:.4f}  {st.seconds:.2f}s")
    # the bar leaves no trace (leave=False): this line stays, e.g. in a saved notebook
    log(f"SFT steps: {done}/{config.sft.steps} in {time.perf_counter() - start:.1f} s")
    folder = session.training_client.export(run_dir / "model", "model").result()
    session.close()
    return Path(folder)
