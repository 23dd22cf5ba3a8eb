"""SFT baseline: cross-entropy on oracle (BFS) trajectories, the checkpoint GRPO starts from.

Each example is a whole multi-turn episode of the run's task (env.task) rendered exactly as a
rollout would render it (system rules; per turn the image, feedback and budget; the oracle's
reply), with loss on the reply tokens only. The states are the task's training states
(`envs.tasks.TASKS`); for the maze never a task of the eval set (`envs.train_maze`).

    python -m workbench sft sft.steps=300
    python -m workbench sft env.task=room sft.steps=100 run_dir=runs/room-sft
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from workbench.envs.protocol import Task
from workbench.envs.tasks import SCRIPTED
from workbench.policy import ChatFormat, Stream, append_reply, chat_format, start_stream
from workbench.rl.rollout import observe
from workbench.session.losses import LossConfig
from workbench.session.types import AdamParams, Datum, per_reply

SFT_INDEX_OFFSET = 50_000_000  # SFT mazes: training indices far from the GRPO ones


def scripted_stream(processor: Any, fmt: ChatFormat, config: Task, state: Any,
                    policy: str = "oracle", seed: int = 0) -> Stream:
    """The token stream of one scripted episode (replies tokenised, then <|im_end|>)."""
    return _play_scripted_stream(processor, fmt, config, state, policy, 0.0, seed)[0]


def _play_scripted_stream(processor: Any, fmt: ChatFormat, config: Task, state: Any,
                          policy: str, noise: float, seed: int) -> tuple[Stream, list[bool]]:
    """Play `policy` (a name in SCRIPTED), replacing a turn by a random move (walls included)
    with probability `noise`; returns the stream and, per reply, whether it was the policy's
    own (trainable) move."""
    rng = np.random.default_rng(seed)
    env = config.make_env()
    obs, info = env.reset(options={"init_state": state})
    stream = observe(start_stream(processor, fmt, config.rules()), processor, fmt, obs, info,
                     config)
    own: list[bool] = []
    while True:
        detour = noise > 0 and rng.random() < noise
        reply = SCRIPTED["random" if detour else policy](env.maze, env.pos, config, rng)
        own.append(not detour)
        tokens = processor.tokenizer.encode(reply, add_special_tokens=False) + [fmt.im_end]
        stream = append_reply(stream, fmt, tokens, [0.0] * len(tokens))
        obs, _, _, _, info = env.step(reply)
        if env.done:
            return stream, own
        stream = observe(stream, processor, fmt, obs, info, config)


def oracle_datum(processor: Any, fmt: ChatFormat, config: Task, state: Any,
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


def sft_steps(training_client, config: Task, states_of: Callable[[int], list[Any]], steps: int,
              adam: AdamParams, noise: float = 0.0,
              schedule: str = "constant") -> Iterator[SFTStep]:
    """Yield after each SFT step (a notebook can plot the loss as it goes); step s trains on
    the oracle's episodes from states_of(s) at `sft_lr(adam, schedule, s, steps)`, each
    seeded by its state's seed. The next step's episodes are played while this step trains."""
    processor = training_client.get_processor()
    fmt = chat_format(processor)
    loss_cfg = LossConfig(reduction="token_mean")

    def datums(step: int) -> list[Datum]:
        return [oracle_datum(processor, fmt, config, s, noise, s.seed) for s in states_of(step)]

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
    """SFT on env.task from config (model, env, generator.max_turns, sft.*) into run_dir;
    returns the exported model folder (`<run_dir>/model`) that GRPO loads as its base. A run_dir
    that is not empty is refused (runfolder.RunFolderExists) unless sft.overwrite, which lists
    what is removed in one line, then removes it."""
    from workbench import run as rundir
    from workbench import runfolder
    from workbench.config import ConfigError, check_loggers, to_dict
    from workbench.opener import check_model, open_session, session_spec
    from workbench.rl.schedule import train_states
    from workbench.storage import is_s3

    check_model(config.model.name)
    check_loggers(config.trainer.logger)
    if is_s3(config.run_dir):
        raise ConfigError(f"run_dir={config.run_dir}: sft writes a local folder, not s3://")
    run_dir = Path(config.run_dir)
    runfolder.clear_or_refuse(runfolder.local_run(run_dir), "sft", config.sft.overwrite, log)
    run_dir.mkdir(parents=True, exist_ok=True)
    rundir.write_json(run_dir / "config.json", to_dict(config))
    spec = session_spec(config, run_dir, full_finetune=config.sft.full_finetune)
    # SFT samples nothing: a Ray session gets trainer workers only
    session = open_session(replace(spec, cluster=replace(spec.cluster, num_engines=0)), log)
    adam = AdamParams(learning_rate=config.sft.learning_rate)
    first, batch = SFT_INDEX_OFFSET + config.trainer.seed * 100_000_000, config.sft.batch_size
    from tqdm.auto import tqdm

    steps = sft_steps(session.training_client, config.task,
                      lambda step: train_states(config, first + (step - 1) * batch, batch),
                      config.sft.steps, adam, config.sft.noise, config.sft.lr_schedule)
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
