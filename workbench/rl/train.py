"""The GRPO loop: only the loop over the phases, with eval / checkpoint / export intervals and
exact resume.

    python -m workbench train model.name=runs/sft/model trainer.total_steps=40

Every step: new sampling client from the current weights -> rollout of P mazes x G episodes
(mazes and sampling seed are functions of the step, so a resumed run sees the same data) ->
score -> group advantages -> datums -> one update (none when no datum carries signal: the loop
says why, once) -> metrics.jsonl (rollout/token_mismatches: datum tokens that are not the ids
the engine drew, expected 0), with the step's phases timed (time/step, time/rollout,
time/update, time/weight_sync, time/rollout_wait; time/eval on evaluation rows); the loop ends on
a "GRPO steps: N/N in S s" line. A full
checkpoint holds the weights, optimiser, step and RNG states; `trainer.resume_mode=latest`
continues from the newest complete one and reproduces an uninterrupted run bit for bit on CPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from workbench import run as rundir
from workbench import runfolder
from workbench.config import RunConfig, check_loggers, to_dict
from workbench.envs.tasks import TASKS
from workbench.opener import check_model, open_session, session_spec
from workbench.policy import Stream
from workbench.rl import phases
from workbench.rl.budget import check_context
from workbench.rl.evaluate import turn_rates
from workbench.rl.rollout import episode_summary
from workbench.rl.schedule import (
    eval_batch,
    refill_batch,
    step_batch,
    step_seed,
    step_update,
)
from workbench.session.clients import TrainingClient
from workbench.session.protocols import SessionLike


@dataclass
class Trainer:
    """A live run: its config, session and folder (a notebook can drive it step by step)."""

    config: RunConfig
    session: SessionLike
    run_dir: Path
    step: int = 0  # last completed step
    last_eval: Any = None  # the newest EvalRecord (its episodes feed the viewers)
    ahead: phases.PendingRollout | None = None  # algorithm.off_policy_steps=1: the next rollout

    @property
    def training_client(self) -> TrainingClient:
        return self.session.training_client


def start(config: RunConfig, log: Any = print) -> Trainer:
    """Open the run folder, then the session. `runfolder.open_run` deletes nothing unasked
    (trainer.overwrite), removes temporaries of interrupted writes, picks the newest intact
    checkpoint and refuses a config change outside its allow-list. Resuming loads the
    checkpoint's weights, optimiser, step and RNG states and drops the metric rows logged after
    it; every start writes its config to config.json; a fresh run writes manifest.json and,
    when trainer.ckpt_interval > 0, its step-0 checkpoint. A config whose episodes could pass
    the engine's context limit is told so in one line first (`rl.budget.check_context`)."""
    if line := fp8_ratio_line(config):
        log(line)
    check_model(config.model.name)  # a missing model folder: one line, no run folder touched
    check_loggers(config.trainer.logger)  # a missing logger extra: the same
    check_context(config, log)  # episodes that could pass the engine's context: one line
    run = runfolder.open_run(config, log)
    run_dir = run.run_dir
    session = open_session(session_spec(config, run_dir), log)
    trainer = Trainer(config, session, run_dir, step=run.step)
    if run.checkpoint is not None:
        session.training_client.load_state(run.checkpoint / "state").result()
    rundir.write_json(run_dir / "config.json", to_dict(config))  # the config of this start
    if run.checkpoint is None or not (run_dir / "manifest.json").is_file():
        threads = (config.cluster.threads_per_actor or None) if config.cluster.address else (
            torch.get_num_threads())  # the trainer's threads (Ray's default share: not known)
        rundir.write_manifest(run_dir, to_dict(config), session.describe(),
                              [TASKS[config.env.task].reward(config.task), phases.env_reward],
                              threads)
    if run.checkpoint is not None:
        runfolder.set_rng_state(run.state["rng"])
        rundir.truncate_metrics(run_dir, trainer.step)
        log(f"resumed from {run.checkpoint} at step {trainer.step}")
        return trainer
    if config.trainer.ckpt_interval:
        runfolder.save_checkpoint(run_dir, 0, session.training_client, config)
    runfolder.mirror_run(run_dir, config)  # s3:// run_dir: upload what is new
    return trainer


def fp8_ratio_line(config: RunConfig) -> str:
    """The line a run with FP8 on one side (speed.fp8_base: the update; engine.vllm_fp8: vLLM)
    and a ratio loss but no truncated importance sampling starts with: trainer and sampler then
    score the sampled tokens far apart, so PPO's ratio leaves its clip range on most of them
    (benchmarks/RESULTS.md, "FP8 for the frozen base", "A step on the H200"). "" when there is
    nothing to say."""
    a = config.algorithm
    keys = [k for k, on in (("speed.fp8_base", config.speed.fp8_base),
                            ("engine.vllm_fp8", config.engine.vllm_fp8)) if on]
    if not keys or a.tis_cap or a.loss not in ("ppo", "importance_sampling"):
        return ""
    return (f"{' and '.join(keys)} with algorithm.tis_cap=0: the trainer's and the sampler's "
            f"log-probs then differ by FP8's rounding, and {a.loss}'s ratio to the sampler "
            "clips or weighs most reply tokens by that error; set algorithm.tis_cap=2 "
            "(truncated importance sampling)")


def run_eval(trainer: Trainer, name: str = "policy") -> phases.EvalRecord:
    """Evaluate the current weights on the fixed set; writes eval/step_N.json."""
    sampler = trainer.training_client.save_weights_and_get_sampling_client()
    record = phases.evaluate(sampler, eval_batch(trainer.config), name, trainer.config.eval.greedy)
    rundir.write_json(trainer.run_dir / "eval" / f"step_{trainer.step:06d}.json",
                      {"step": trainer.step, "results": [r.__dict__ for r in record.results]})
    trainer.last_eval = record
    return record


def train_step(trainer: Trainer) -> dict[str, float]:
    """One GRPO step; returns (and logs) its metrics row. With algorithm.off_policy_steps=1 the
    step's rollout was started by the step before (from that step's weights) and this step
    starts the next one before its update (`samples_ahead`)."""
    c, step = trainer.config, trainer.step + 1
    t0 = time.perf_counter()
    ahead, trainer.ahead = trainer.ahead, None
    if ahead is not None and ahead.seed != step_seed(c, step):
        ahead = None  # another step's (a step interrupted in a notebook cell): sample anew
    ro_ahead = ahead.result() if ahead is not None else None  # sampled during the last update
    waited = time.perf_counter() - t0
    sampler = trainer.training_client.save_weights_and_get_sampling_client()
    sync_seconds = time.perf_counter() - t0 - waited  # Ray: the new weights reach every engine
    ro = ro_ahead if ro_ahead is not None else phases.rollout(sampler, step_batch(c, step))
    ro, sampled_P_G = refill(c, sampler, ro, step)
    speed = trainer.session.speed_metrics()  # this rollout's (queued before the next one)
    if samples_ahead(c, step):
        trainer.ahead = phases.start_rollout(sampler, step_batch(c, step + 1))
    sc = phases.score(ro)
    adv = phases.advantages(sc.rewards_P_G, c.algorithm.advantage, ro.episodes_P_G,
                            c.algorithm.step_advantage, c.algorithm.step_gamma)
    datums = phases.make_datums(ro, adv)
    settings = step_update(c, step)
    up = phases.update(trainer.training_client, datums, settings) if datums else (
        phases.UpdateRecord.empty(settings.adam.learning_rate))  # no step; the loop says why
    trainer.step = step
    row = _metrics_row(step, ro, sc, adv, up, time.perf_counter() - t0, sampled_P_G)
    row["time/weight_sync"] = sync_seconds
    row["time/rollout_wait"] = waited if ahead is not None else ro.seconds
    row["rollout/policy_lag"] = 1 if ahead is not None else 0  # steps behind the updated weights
    row["rollout/token_mismatches"] = phases.token_mismatches(ro, adv, datums)  # expected 0
    row |= speed.result()  # speed/*: 0.0 for a fast path that fell back
    if c.trainer.keep_step_records:
        index = phases.datum_index(ro, adv)
        rundir.save_step_record(trainer.run_dir / "steps" / f"step_{step:06d}",
                                [[episode_summary(ep) for ep in g] for g in ro.episodes_P_G],
                                sc.rewards_P_G, adv.advantages_P_G, index, datums,
                                {"step": step, "adam": settings.adam.__dict__,
                                 "loss_fn": settings.loss_fn,
                                 "loss_config": settings.loss.__dict__, "metrics": row})
    rundir.append_metrics(trainer.run_dir, row, trainer.config.trainer.logger)
    trainer.session.report_metrics(row, trainer.run_dir.name)  # Ray: to Ray's metrics
    return row


def refill(config: RunConfig, sampler: Any, ro: phases.RolloutRecord,
           step: int) -> tuple[phases.RolloutRecord, list[list[Any]]]:
    """algorithm.dynamic_sampling (DAPO): each group of `ro` that carries no signal is replaced by
    the group of a fresh refill maze (`schedule.refill_mazes`), for up to N rounds or until
    every group carries signal. Returns the record to train on (P groups, the last round's
    flat ones included) and every group sampled this step (for the success metrics)."""
    c = config
    sampled_P_G = list(ro.episodes_P_G)
    for round_ in range(1, c.algorithm.dynamic_sampling + 1):
        adv = phases.advantages(phases.score(ro).rewards_P_G, c.algorithm.advantage,
                                ro.episodes_P_G, c.algorithm.step_advantage, c.algorithm.step_gamma)
        live = {p for p, _ in phases.datum_index(ro, adv)}
        flat = [p for p in range(len(ro.episodes_P_G)) if p not in live]
        if not flat:
            break
        new = phases.rollout(sampler, refill_batch(c, step, round_, len(flat)))
        groups = list(ro.episodes_P_G)
        for p, group in zip(flat, new.episodes_P_G):
            groups[p] = group
        sampled_P_G += new.episodes_P_G
        ro = replace(ro, episodes_P_G=groups, seconds=ro.seconds + new.seconds)
    return ro, sampled_P_G


def samples_ahead(config: RunConfig, step: int) -> bool:
    """Whether step `step` starts the next step's rollout before its update: with
    algorithm.off_policy_steps=1, unless it is the last step or a checkpoint step (the step after
    a checkpoint samples on-policy, in a resumed run as in an uninterrupted one)."""
    t = config.trainer
    return config.algorithm.off_policy_steps == 1 and step < t.total_steps \
        and not t.checkpoint_due(step)


def _metrics_row(step: int, ro: phases.RolloutRecord, sc: phases.ScoreRecord,
                 adv: phases.AdvantageRecord, up: phases.UpdateRecord, seconds: float,
                 sampled_P_G: list[list[Any]]) -> dict:
    """The step's metrics; success and turns count every episode sampled (refills included),
    the rest the P groups trained on."""
    flat, everything = ro.flat, [ep for group in sampled_P_G for ep in group]
    solved = [ep.turns for ep in everything if ep.success]
    row = {
        "step": step,
        "reward/mean": float(sc.rewards_P_G.mean()),
        "reward/std": float(sc.rewards_P_G.std()),
        "rollout/success_rate": float(np.mean([ep.success for ep in everything])),
        "rollout/turns_mean": float(np.mean([ep.turns for ep in everything])),
        "rollout/groups_sampled": len(sampled_P_G),
        "rollout/reply_tokens_mean": float(np.mean(  # model rollouts: every episode has a stream
            [sum(cast(Stream, ep.stream).loss_mask_T) for ep in flat])),
        "rollout/tokens_mean": float(np.mean([len(cast(Stream, ep.stream)) for ep in flat])),
        "rollout/entropy": ro.reply_entropy(),
        "rollout/zero_variance_groups": adv.zero_variance_groups,
        "rollout/zero_variance_frac": adv.zero_variance_groups / len(ro.episodes_P_G),
        **{f"rollout/{k}": v for k, v in turn_rates(everything).items()},
        "update/datums": up.datums,
        "update/learning_rate": up.learning_rate,
        "time/rollout": ro.seconds,
        "time/update": up.seconds,
        "time/step": seconds,
    }
    if solved:  # left out (not 0) when no episode was solved
        row["rollout/solved_turns_mean"] = float(np.mean(solved))
    if up.datums:  # a step without an update logs no loss, KL, entropy or grad norm
        row |= {"update/loss": up.metrics["loss"],
                "update/kl_sampler_trainer": up.metrics["kl_sampler_trainer"],
                "update/entropy": up.metrics["entropy"],
                "update/clip_fraction": up.metrics["clip_fraction"],
                "update/tokens": up.metrics["tokens"], "update/grad_norm": up.grad_norm}
        if "tis_truncated_fraction" in up.metrics:  # algorithm.tis_cap
            row["update/tis_truncated_fraction"] = up.metrics["tis_truncated_fraction"]
    return row


def step_line(row: dict[str, Any]) -> str:
    """The one line a step prints; a step whose groups all had zero reward variance says that
    it made no update."""
    head = (f"step {row['step']:>4}  reward {row['reward/mean']:.3f}  success "
            f"{row['rollout/success_rate']:.3f}  zero-var {row['rollout/zero_variance_groups']}"
            f"  bumps {row['rollout/wall_bump_rate']:.2f}  entropy {row['rollout/entropy']:.2f}")
    if "update/loss" not in row:
        return f"{head}  no update: every group had zero reward variance  {row['time/step']:.1f}s"
    return (f"{head}  loss {row['update/loss']:+.4f}  kl {row['update/kl_sampler_trainer']:.1e}"
            f"  {row['time/step']:.1f}s")


class ClusterLostError(ConnectionError):
    """The Ray cluster went away mid-run; the run folder and its checkpoints are intact."""


def cluster_lost(config: RunConfig, run_dir: Path, err: BaseException) -> ClusterLostError:
    """The error a user sees when the cluster disappears: what was lost, what was kept, and
    the command that continues."""
    steps = [r["step"] for r in rundir.read_metrics(run_dir) if "reward/mean" in r]
    ckpt = runfolder.find_checkpoint(run_dir, log=lambda _: None)  # the newest intact one
    kept = f"{ckpt} (step {runfolder.step_of(ckpt)})" if ckpt else "none yet"
    return ClusterLostError(
        f"lost the Ray cluster at {config.cluster.address} after step {max(steps, default=0)} "
        f"({type(err).__name__}: {err}). The run folder {run_dir} is intact; newest complete "
        f"checkpoint: {kept}. Once the cluster is back, re-run the same command with "
        "trainer.resume_mode=latest (or with cluster.address= to go on in-process).")


def train(config: RunConfig, log: Any = print) -> Trainer:
    """The loop: evaluate, then steps with eval / checkpoint / export intervals; final eval.

    On Ray, an actor that dies (killed, out of memory, its node lost) ends the session: the
    loop closes it, opens a new one and resumes from the last complete checkpoint, at most
    cluster.max_restarts times. Steps after that checkpoint are redone, so none is lost or
    logged twice, and the run ends as an undisturbed one would. When the whole cluster goes
    away (Ray Client loses its connection), a ClusterLostError names the checkpoint kept."""
    trainer = start(config, log)
    try:
        return train_started(trainer, log)
    except ConnectionError as err:
        if not config.cluster.address or isinstance(err, ClusterLostError):
            raise
        raise cluster_lost(config, trainer.run_dir, err) from err


def train_started(trainer: Trainer, log: Any) -> Trainer:
    """`train` after its `start`: the loop, reopening the session from the last checkpoint on
    a recoverable error (a benchmark times this part alone)."""
    config, restarts = trainer.config, 0
    while True:
        try:
            return _loop(trainer, log)
        except trainer.session.recoverable_errors as err:
            restarts += 1
            if restarts > config.cluster.max_restarts:
                raise
            if config.trainer.ckpt_interval == 0:
                log(f"{type(err).__name__} after step {trainer.step}: no checkpoint to reopen "
                    "the session from (trainer.ckpt_interval=0), so the run stops here")
                raise
            log(f"{type(err).__name__} after step {trainer.step}: reopening the session from the"
                f" last checkpoint (restart {restarts}/{config.cluster.max_restarts})")
            trainer.session.close()
            resume = replace(config, trainer=replace(config.trainer, resume_mode="latest"))
            trainer = start(resume, log)


def _loop(trainer: Trainer, log: Any) -> Trainer:
    from tqdm.auto import tqdm

    t = trainer.config.trainer
    if trainer.step == 0 and not _eval_logged(trainer.run_dir, 0):
        _log_eval(trainer, run_eval(trainer, "grpo"), log)
    bar = tqdm(total=t.total_steps, initial=trainer.step, desc="GRPO steps", leave=False,
               disable=None)  # None: no bar when output is not a terminal
    log = tqdm.write if log is print else log  # one summary line per step above the bar
    first, start, told = trainer.step, time.perf_counter(), False
    if trainer.config.algorithm.off_policy_steps and not trainer.session.overlaps_sampling:
        log("algorithm.off_policy_steps=1 with engine.name=transformers in-process: each "
            "step's update and the next step's rollout (sampled from the weights before that "
            "update) take turns on the session's one worker, with no overlap; with "
            "engine.name=vllm or on Ray (cluster.address) they overlap")
    with bar:
        while trainer.step < t.total_steps:
            row = train_step(trainer)
            bar.update(1)
            log(step_line(row))
            if "update/loss" not in row and not told:  # once per run: why there was no update
                log(no_update_line(row))
                told = True
            _after_step(trainer, log)
    log(progress_line("GRPO steps", trainer.step, t.total_steps, first,
                      time.perf_counter() - start))  # the bar leaves no trace: this line does
    return trainer


def no_update_line(row: dict[str, Any]) -> str:
    """Why a step made no update (printed at the first such step of a run)."""
    return (f"update skipped at step {row['step']}: 0 datums, all "
            f"{row['rollout/zero_variance_groups']} groups had zero reward variance (every "
            "episode in a group got the same reward), so no optimiser step; later steps like it "
            "say 'no update' on their line")


def progress_line(what: str, done: int, total: int, first: int, seconds: float) -> str:
    """The line a progress bar leaves behind, e.g. "GRPO steps: 3/3 in 12.3 s"; a resumed
    loop also says where it started."""
    resumed = f" (resumed at step {first})" if first else ""
    return f"{what}: {done}/{total} in {seconds:.1f} s{resumed}"


def _after_step(trainer: Trainer, log: Any) -> None:
    """The intervals, exactly as TrainerConfig's docstrings say: evaluation after each
    multiple of eval_interval and after the last step; adapter export after each multiple of
    hf_save_interval and after the last step (never when 0); full checkpoint after each
    multiple of ckpt_interval (never when 0), written last."""
    t, step = trainer.config.trainer, trainer.step
    if t.eval_due(step):
        _log_eval(trainer, run_eval(trainer, "grpo"), log)
    if t.export_due(step):
        trainer.training_client.export(
            trainer.run_dir / runfolder.EXPORTS / runfolder.step_folder(step), "adapter").result()
    if t.checkpoint_due(step):
        runfolder.save_checkpoint(trainer.run_dir, step, trainer.training_client, trainer.config)
    runfolder.mirror_run(trainer.run_dir, trainer.config)  # s3:// run_dir: upload what is new


def _eval_logged(run_dir: Path, step: int) -> bool:
    """True when metrics.jsonl already holds the evaluation of `step` (a resumed step 0)."""
    return any(r["step"] == step and "eval/n_mazes" in r for r in rundir.read_metrics(run_dir))


def _log_eval(trainer: Trainer, record: phases.EvalRecord, log: Any) -> None:
    row: dict[str, Any] = {"step": trainer.step, "time/eval": record.seconds}
    for r in record.results:
        log(f"eval step {trainer.step}: {r.mode} {r.solved:.1f}/{r.n_mazes} "
            f"(ceiling {r.ceiling}/{r.n_mazes}), mean turns {r.mean_turns:.2f}")
        row |= {f"eval/{r.mode}_success": r.success_rate, f"eval/{r.mode}_solved": r.solved,
                f"eval/{r.mode}_turns": r.mean_turns, f"eval/{r.mode}_passes": r.episodes_per_maze,
                "eval/ceiling": r.ceiling, "eval/n_mazes": r.n_mazes}
    rundir.append_metrics(trainer.run_dir, row, trainer.config.trainer.logger)
    trainer.session.report_metrics(row, trainer.run_dir.name)
