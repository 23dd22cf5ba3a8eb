"""The GRPO phases as plain functions over plain records, one notebook cell each:

    ro   = rollout(sampler, Batch(task, states_P, G=8, params=SamplingParams(), seed=0))
    sc   = score(ro)                              # rewards_P_G
    adv  = advantages(sc.rewards_P_G, "grpo")     # advantages_P_G, zero-variance groups
    data = make_datums(ro, adv)                   # one datum per episode that carries signal
    up   = update(training_client, data, UpdateSettings(adam=AdamParams(learning_rate=3e-4)))
    ev   = evaluate(sampler, Batch(task, eval_states, G=2, params=SamplingParams(), seed=0))

A `Batch` is what a rollout plays (the task, its initial states, G, the sampling parameters and
seed); `UpdateSettings` how an update trains (loss, optimiser step, mini-batches). From a run
config, `rl.schedule` makes both for any step (`step_batch`, `step_update`) and the eval set's
batch (`eval_batch`).

Advantages are group-relative: GRPO (r - mean) / (std + 1e-6) with the unbiased std as SkyRL
computes it, Dr. GRPO (r - mean), RLOO (r - mean of the others). A group whose rewards are all
equal carries no signal: its advantages are exactly zero, it is counted, and its episodes are
left out of the update (they would add zero gradient at full cost). A batch with no datums left
makes no update at all (no forward_backward, no optimiser step) and says so in a warning.

Each phase checks that it was handed the record it takes and names it in one line otherwise;
every record prints as one short line, and the tables (rewards, advantages, eval results) as
HTML tables in Jupyter.
"""

from __future__ import annotations

import html
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, cast

import numpy as np

from workbench.advantages import ADVANTAGES
from workbench.envs.protocol import Task
from workbench.policy import SamplingParams, Stream
from workbench.rl.evaluate import TABLE_HEADER, EvalResult, summarize
from workbench.rl.rollout import Episode, play_episodes
from workbench.session.clients import SamplingClient, TrainingClient
from workbench.session.losses import REDUCTION_SCALES, LossConfig
from workbench.session.types import AdamParams, Datum, per_reply


def _takes(phase: str, value: Any, want: type | tuple[type, ...], what: str, hint: str) -> None:
    """TypeError in one line unless `value` is a `want`: the phase, what it takes, what it got
    and how to make what it takes."""
    if not isinstance(value, want):
        raise TypeError(f"{phase} takes {what}, not {type(value).__name__}: {hint}")


def _check_states(states_P: Any) -> None:
    """Initial states, not the maze seeds they are made from."""
    if not isinstance(states_P, list | tuple) or any(isinstance(s, int | str) for s in states_P):
        got = type(states_P).__name__ if not isinstance(states_P, list | tuple) else (
            f"{type(states_P[0]).__name__}s such as {states_P[0]!r}")
        raise TypeError(f"states_P must be initial states (a list, e.g. eval_set(7, 8) or "
                        f"step_mazes(config, 1)), not {got}: a maze seed becomes a state with "
                        "train_states or eval_set")


def _stats(values: np.ndarray) -> str:
    """"mean m, range [lo, hi]" of an array ("no values" when empty)."""
    if values.size == 0:
        return "no values"
    return f"mean {values.mean():+.3g}, range [{values.min():+.3g}, {values.max():+.3g}]"


def _grid_html(title: str, values_P_G: np.ndarray, rows: int = 32) -> str:
    """A P x G table (a row per maze, a column per sample) of its first `rows` mazes."""
    head = "".join(f"<th>g={g}</th>" for g in range(values_P_G.shape[1]))
    body = "".join(f"<tr><th>p={p}</th>" + "".join(f"<td>{v:+.3g}</td>" for v in row) + "</tr>"
                   for p, row in enumerate(values_P_G[:rows]))
    more = (f"<tr><td colspan={values_P_G.shape[1] + 1}>... {len(values_P_G) - rows} more mazes"
            "</td></tr>") if len(values_P_G) > rows else ""
    return (f"<b>{html.escape(title)}</b><table><tr><th></th>{head}</tr>{body}{more}</table>")


@dataclass
class RolloutRecord:
    """Episodes of one rollout: G per maze, with the settings that produced them."""

    episodes_P_G: list[list[Episode]]
    params: SamplingParams
    seed: int
    seconds: float

    def __repr__(self) -> str:
        """One line (episodes hold token streams and pixels: print `.flat[k]` for one)."""
        P, G = len(self.episodes_P_G), len(self.episodes_P_G[0]) if self.episodes_P_G else 0
        solved = sum(ep.success for ep in self.flat)
        return (f"RolloutRecord(P={P} x G={G} episodes, {solved} solved, temperature "
                f"{self.params.temperature}, seed {self.seed}, {self.seconds:.1f} s)")

    @property
    def flat(self) -> list[Episode]:
        return [ep for group in self.episodes_P_G for ep in group]

    def reply_entropy(self) -> float:
        """Mean over all replies of -sum(sampler log-prob of its tokens): an unbiased estimate
        of the sampling policy's entropy per turn, in nats (0 when streams were dropped)."""
        nats, replies = 0.0, 0
        for ep in self.flat:
            if ep.stream is None:
                continue
            mask, logp = ep.stream.loss_mask_T, ep.stream.logprobs_T
            nats -= sum(lp for lp, m in zip(logp, mask) if m)
            replies += ep.turns
        return nats / replies if replies else 0.0


@dataclass(frozen=True)
class Batch:
    """What one rollout plays: G episodes of each initial state of a task (a maze, or any task
    of `envs.tasks`), sampled with `params` from `seed`; `history_images` > 0 keeps only the
    last k turns' images in the model's context (generator.history_images)."""

    task: Task
    states_P: list[Any]
    G: int
    params: SamplingParams
    seed: int
    history_images: int = 0

    def __post_init__(self) -> None:
        _check_states(self.states_P)

    def __repr__(self) -> str:
        window = f", last {self.history_images} images" if self.history_images else ""
        return (f"Batch({type(self.task).__name__}, P={len(self.states_P)} x G={self.G}, "
                f"temperature {self.params.temperature}, seed {self.seed}{window})")


def rollout(sampler: SamplingClient, batch: Batch) -> RolloutRecord:
    """The batch's episodes, sampled from the sampling client's weights version."""
    return start_rollout(sampler, batch).result()


@dataclass
class PendingRollout:
    """A rollout under way (`start_rollout`): `.result()` waits for its RolloutRecord, whose
    seconds run from the start to the last episode, however late the result is asked for."""

    future: Future
    params: SamplingParams
    seed: int
    started: float
    finished: list[float] = field(default_factory=list)

    def __repr__(self) -> str:
        state = "done" if self.future.done() else "running"
        return f"PendingRollout(seed {self.seed}, {state})"

    def result(self) -> RolloutRecord:
        episodes = self.future.result()
        end = self.finished[0] if self.finished else time.perf_counter()
        return RolloutRecord(episodes, self.params, self.seed, end - self.started)


def start_rollout(sampler: SamplingClient, batch: Batch) -> PendingRollout:
    """`rollout` without waiting: the episodes are sampled (on Ray, by the engines) while the
    caller goes on, e.g. with an update."""
    _takes("rollout", batch, Batch, "a Batch", "pass schedule.step_batch(config, step), or "
           "Batch(task, states_P, G, params, seed)")
    b, start = batch, time.perf_counter()
    future = sampler.play(episode_loop(b.history_images), b.task, b.states_P, b.G, b.params,
                          b.seed)
    pending = PendingRollout(future, b.params, b.seed, start)
    future.add_done_callback(lambda _: pending.finished.append(time.perf_counter()))
    return pending


def episode_loop(history_images: int) -> Callable[..., list[list[Episode]]]:
    """The episode loop a sampler plays: `rollout.play_episodes`, with an image window when
    history_images > 0."""
    return partial(play_episodes, history_images=history_images) if history_images \
        else play_episodes


# A reward function follows TRL's protocol: a list of episodes in, one float per episode out.
RewardFn = Callable[[list[Episode]], list[float]]


def env_reward(episodes: list[Episode]) -> list[float]:
    """The environment's episode reward (task term, plus the format term if configured)."""
    return [ep.reward for ep in episodes]


def success_reward(episodes: list[Episode]) -> list[float]:
    """1.0 for a solved episode, else 0.0."""
    return [float(ep.success) for ep in episodes]


REWARD_FNS: dict[str, RewardFn] = {"env": env_reward, "success": success_reward}


@dataclass
class ScoreRecord:
    """Rewards per maze and sample, and each reward function's part."""

    rewards_P_G: np.ndarray
    parts: dict[str, np.ndarray] = field(default_factory=dict)

    def __repr__(self) -> str:
        """One line: shape, reward statistics, zero-variance groups, the reward functions."""
        P, G = self.rewards_P_G.shape
        flat = int(np.all(self.rewards_P_G == self.rewards_P_G[:, :1], axis=1).sum()) if G else P
        return (f"ScoreRecord(P={P} x G={G} rewards, {_stats(self.rewards_P_G)}, {flat} "
                f"zero-variance groups, parts {', '.join(self.parts) or 'none'})")

    def _repr_html_(self) -> str:
        return _grid_html(f"rewards_P_G ({', '.join(self.parts)})", self.rewards_P_G)


def score(record: RolloutRecord, reward_fns: dict[str, float] | None = None) -> ScoreRecord:
    """Weighted sum of reward functions (names in REWARD_FNS -> weight); default env reward."""
    _takes("score", record, RolloutRecord, "a RolloutRecord",
           "pass the record that rollout(...) returns, or wrap episodes as "
           "RolloutRecord(episodes_P_G, params, seed, seconds)")
    weights = reward_fns or {"env": 1.0}
    P, G = len(record.episodes_P_G), len(record.episodes_P_G[0])
    parts = {name: np.asarray(REWARD_FNS[name](record.flat), dtype=np.float64).reshape(P, G)
             for name in weights}
    # an array: `weights` is never empty, so sum's 0 start is always added to one
    total = cast(np.ndarray, sum(weights[name] * part for name, part in parts.items()))
    return ScoreRecord(rewards_P_G=total, parts=parts)


@dataclass
class AdvantageRecord:
    """Advantages per maze and sample; zero-variance groups are zeroed and counted. With step
    advantages, each episode also has one advantage per turn (its own plus the weighted
    step-level one); without, every turn of an episode carries the episode's advantage."""

    advantages_P_G: np.ndarray
    zero_variance_groups: int
    estimator: str
    turn_advantages_P_G: list[list[np.ndarray]] | None = None
    """Per maze, per episode: an array with one advantage per turn (None: episode-level only)."""

    def __repr__(self) -> str:
        """One line: estimator, shape, zero-variance groups, advantage statistics."""
        P, G = self.advantages_P_G.shape
        turns = ", per-turn step advantages" if self.turn_advantages_P_G is not None else ""
        return (f"AdvantageRecord({self.estimator}, P={P} x G={G}, {self.zero_variance_groups} "
                f"zero-variance groups, {_stats(self.advantages_P_G)}{turns})")

    def _repr_html_(self) -> str:
        return _grid_html(f"advantages_P_G ({self.estimator}, {self.zero_variance_groups} "
                          "zero-variance groups)", self.advantages_P_G)

    def of_turns(self, p: int, g: int, turns: int) -> np.ndarray:
        """The advantage of each turn of episode g of maze p."""
        if self.turn_advantages_P_G is None:
            return np.full(turns, self.advantages_P_G[p, g])
        return self.turn_advantages_P_G[p][g]


def advantages(rewards_P_G: np.ndarray, estimator: str = "grpo",
               episodes_P_G: list[list[Episode]] | None = None, step_weight: float = 0.0,
               gamma: float = 0.95) -> AdvantageRecord:
    """Group-relative advantages by `estimator` (a key of ADVANTAGES); with `step_weight` > 0
    (and the episodes), each turn also gets step_weight times its step-level advantage
    (`step_advantages`)."""
    if estimator not in ADVANTAGES:
        raise ValueError(f"unknown estimator {estimator!r}; choose one of {sorted(ADVANTAGES)}")
    if not isinstance(rewards_P_G, np.ndarray) or rewards_P_G.ndim != 2:
        hint = ": pass score(ro).rewards_P_G" if isinstance(rewards_P_G, ScoreRecord) else ""
        raise TypeError(f"advantages takes rewards_P_G, a (P, G) numpy array, not "
                        f"{type(rewards_P_G).__name__}{hint}")
    adv_P_G = ADVANTAGES[estimator](rewards_P_G)
    flat_P = np.all(adv_P_G == adv_P_G[:, :1], axis=1)  # no signal: equal rewards (not parity)
    adv_P_G[flat_P] = 0.0
    record = AdvantageRecord(adv_P_G, int(flat_P.sum()), estimator)
    if step_weight > 0:
        if episodes_P_G is None:
            raise ValueError("step advantages need the episodes (episodes_P_G)")
        steps_P_G = step_advantages(episodes_P_G, rewards_P_G, estimator, gamma)
        record.turn_advantages_P_G = [[adv_P_G[p, g] + step_weight * a_T
                                       for g, a_T in enumerate(steps_G)]
                                      for p, steps_G in enumerate(steps_P_G)]
    return record


def step_advantages(episodes_P_G: list[list[Episode]], rewards_P_G: np.ndarray, estimator: str,
                    gamma: float) -> list[list[np.ndarray]]:
    """GiGPO's step-level advantages (Feng et al., 2025): within a maze's group, every turn taken
    from the same square is one "anchor" group; a turn's return is its episode's reward
    discounted by the turns left after it (gamma ** (T - 1 - t) * r), and its advantage is that
    return against the others of its anchor group, by the same estimator. So a move into a wall
    or away from the goal scores below the moves other samples made from the same square, even
    when the whole group failed or succeeded alike. Anchor groups of one turn, or of equal
    returns, get 0."""
    out_P_G = []
    for group, rewards_G in zip(episodes_P_G, rewards_P_G):
        returns_G = [rewards_G[g] * gamma ** np.arange(ep.turns - 1, -1, -1, dtype=float)
                     for g, ep in enumerate(group)]
        anchors: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        for g, ep in enumerate(group):
            for t in range(ep.turns):
                anchors.setdefault(tuple(ep.positions[t]), []).append((g, t))
        adv_G = [np.zeros(ep.turns) for ep in group]
        for members in anchors.values():
            returns_N = np.array([[returns_G[g][t] for g, t in members]])
            if len(members) < 2 or np.all(returns_N == returns_N[0, 0]):
                continue
            for (g, t), a in zip(members, ADVANTAGES[estimator](returns_N)[0]):
                adv_G[g][t] = a
        out_P_G.append(adv_G)
    return out_P_G


def datum_index(record: RolloutRecord, adv: AdvantageRecord,
                drop_zero: bool = True) -> list[tuple[int, int]]:
    """(maze, sample) of each datum make_datums makes, in order (an episode played with an
    image window gives one datum per turn that carries signal)."""
    return [(p, g) for p, g, _ in _datum_plan("datum_index", record, adv, drop_zero)]


def make_datums(record: RolloutRecord, adv: AdvantageRecord,
                drop_zero: bool = True) -> list[Datum]:
    """One datum per episode that carries signal: its stream, each reply's tokens carrying that
    turn's advantage (`AdvantageRecord.of_turns`). An episode whose prompts an image window cut
    (`windowed`) gives one datum per turn instead: the prompt that turn was sampled from
    (`Episode.turn_streams`) and its reply, the reply alone weighted, so every datum holds
    exactly the tokens the sampler was given and drew."""
    return [datum for _, _, datum in _datum_plan("make_datums", record, adv, drop_zero)]


def _datum_plan(phase: str, record: RolloutRecord, adv: AdvantageRecord,
                drop_zero: bool) -> list[tuple[int, int, Datum]]:
    """(maze, sample, datum) of every datum, in order (`phase` names the caller in errors)."""
    _check_pair(phase, record, adv)
    plan = []
    for p, group in enumerate(record.episodes_P_G):
        for g, ep in enumerate(group):
            adv_R = adv.of_turns(p, g, replies(_stream(ep)))
            if windowed(ep):
                plan += [(p, g, last_reply_datum(s, a)) for s, a in zip(ep.turn_streams, adv_R)
                         if not drop_zero or a != 0.0]
            elif not drop_zero or np.any(adv_R != 0.0):
                plan.append((p, g, turn_datum(_stream(ep), adv_R)))
    return plan


def token_mismatches(record: RolloutRecord, adv: AdvantageRecord, datums: list[Datum],
                     drop_zero: bool = True) -> int:
    """Reply tokens of the datums that are not the token ids the engine returned for that turn
    (`Episode.sampled_tokens`, recorded at sample time): 0 when every datum holds exactly what
    was sampled, never a re-tokenization of its text. Each datum is matched with its episode by
    `datum_index` (the same `drop_zero` as make_datums); `reply_mismatches` counts one."""
    index = datum_index(record, adv, drop_zero)
    if len(index) != len(datums):
        raise ValueError(f"token_mismatches: {len(datums)} datums for the {len(index)} that "
                         "make_datums(record, adv) makes: pass that list")
    return sum(reply_mismatches(record.episodes_P_G[p][g].sampled_tokens, d.stream)
               for (p, g), d in zip(index, datums))


def reply_mismatches(sampled_R: list[list[int]], stream: Stream) -> int:
    """Over the stream's replies (runs of loss-mask tokens; a windowed turn's stream holds the
    first replies of its episode), the tokens that differ from sampled_R[r], the ids drawn for
    turn r: positions holding another id, plus the difference in length (a reply with no
    sampled turn counts all its tokens)."""
    replies_R: list[list[int]] = [[] for _ in range(replies(stream))]
    for token, r in zip(stream.tokens_T, stream.reply_index_T()):
        if r >= 0:
            replies_R[r].append(token)
    want_R = list(sampled_R[:len(replies_R)]) + [[]] * (len(replies_R) - len(sampled_R))
    return sum(sum(a != b for a, b in zip(got, want)) + abs(len(got) - len(want))
               for got, want in zip(replies_R, want_R))


def _check_pair(phase: str, record: Any, adv: Any) -> None:
    _takes(phase, record, RolloutRecord, "the RolloutRecord first", "pass ro = rollout(...)")
    _takes(phase, adv, AdvantageRecord, "an AdvantageRecord second",
           "pass advantages(score(ro).rewards_P_G)")


def _stream(episode: Episode) -> Stream:
    """A model rollout's token stream (scripted episodes have none)."""
    assert episode.stream is not None, "a scripted episode has no token stream to train on"
    return episode.stream


def replies(stream: Stream) -> int:
    """Replies in a stream: runs of loss-mask tokens (one per turn of a rollout)."""
    return 1 + max(stream.reply_index_T(), default=-1)


def windowed(episode: Episode) -> bool:
    """Whether an image window cut images from the episode's prompts (then its turns are
    trained one datum each; otherwise every prompt was a prefix of its stream)."""
    return bool(episode.turn_streams) and \
        len(episode.turn_streams[-1].images) < len(_stream(episode).images)


def last_reply_datum(stream: Stream, advantage: float) -> Datum:
    """A datum whose last reply carries `advantage` with weight 1; the earlier replies in it
    are context (weight 0)."""
    index_T = stream.reply_index_T()
    last = max(index_T, default=-1)
    return Datum(stream, tuple(float(advantage) if r == last >= 0 else 0.0 for r in index_T),
                 tuple(1.0 if r == last >= 0 else 0.0 for r in index_T))


def turn_datum(stream: Stream, advantages_R: np.ndarray) -> Datum:
    """A datum whose r-th reply (run of loss-mask tokens) carries advantages_R[r], weight 1."""
    return Datum(stream, per_reply(stream, advantages_R),
                 tuple(float(m) for m in stream.loss_mask_T))


@dataclass
class UpdateRecord:
    """Loss metrics of the forward_backward calls and the optimiser step."""

    metrics: dict[str, float]
    grad_norm: float
    learning_rate: float
    datums: int
    seconds: float

    @classmethod
    def empty(cls, learning_rate: float) -> UpdateRecord:
        """The record of an update skipped for want of datums (no metrics, no step)."""
        return cls({}, 0.0, learning_rate, 0, 0.0)

    def __repr__(self) -> str:
        """One line: datums, loss, grad norm, KL, learning rate, time."""
        if not self.datums:
            return f"UpdateRecord(skipped: 0 datums, lr {self.learning_rate:.3g})"
        m = self.metrics
        return (f"UpdateRecord({self.datums} datums, {m.get('tokens', 0)} tokens, loss "
                f"{m.get('loss', 0.0):+.4g}, grad norm {self.grad_norm:.3g}, kl "
                f"{m.get('kl_sampler_trainer', 0.0):.2g}, clip {m.get('clip_fraction', 0.0):.3f}"
                f", lr {self.learning_rate:.3g}, {self.seconds:.1f} s)")


NO_DATUMS = ("update skipped: 0 datums, so no forward_backward and no optimiser step "
             "(make_datums keeps only episodes with a non-zero advantage: there are none when "
             "every episode in each group got the same reward)")


def global_weights(datums: list[Datum], reduction: str) -> list[Datum]:
    """Fold a mean reduction over the WHOLE batch into the weights (`REDUCTION_SCALES`), so that
    summing the loss over any split into mini-batches gives exactly the batch's token (or
    sequence) mean."""
    if reduction == "sum":
        return datums
    tokens_B = [sum(1 for w in d.weights_T if w != 0) for d in datums]
    scale_B = REDUCTION_SCALES[reduction](tokens_B)
    return [replace(d, weights_T=tuple(w * s for w in d.weights_T))
            for d, s in zip(datums, scale_B)]


@dataclass(frozen=True)
class UpdateSettings:
    """How `update` trains on a batch of datums: the loss, the optimiser step, and how the
    batch is split (PPO's mini-batch updates: SkyRL's policy_mini_batch_size and
    update_epochs_per_batch)."""

    loss_fn: str = "ppo"  # a key of session.losses.LOSSES
    loss: LossConfig = field(default_factory=LossConfig)
    adam: AdamParams = field(default_factory=AdamParams)
    minibatch: int = 16  # datums per forward_backward call (does not change the gradient)
    mini_batches: int = 1  # optimiser steps per batch, one per contiguous mini-batch
    epochs: int = 1  # passes over the batch
    bucket_by_length: bool = False  # sort by length first: each call pads to a near length

    def __post_init__(self) -> None:
        _takes("UpdateSettings", self.loss_fn, str, "loss_fn, a loss name such as \"ppo\"",
               "see workbench.session.losses.LOSSES")
        _takes("UpdateSettings", self.loss, LossConfig, "loss, a LossConfig",
               "pass LossConfig(reduction=config.algorithm.loss_reduction)")
        _takes("UpdateSettings", self.adam, AdamParams, "adam, an AdamParams",
               "pass AdamParams(learning_rate=3e-4)")


def update(training_client: TrainingClient, datums: list[Datum],
           settings: UpdateSettings = UpdateSettings()) -> UpdateRecord:
    """`settings.epochs` passes over the batch, each split into `mini_batches` contiguous
    mini-batches; each mini-batch is forward_backward over chunks of `minibatch` datums (queued
    back to back) and then one optim_step. The loss config's mean reduction is applied over
    each mini-batch (`global_weights`), so the chunking does not change the gradient. Metrics:
    loss and grad norm averaged over the optimizer steps, the rest token-weighted over every
    call. No datums: no call at all, a RuntimeWarning (NO_DATUMS) and `UpdateRecord.empty`."""
    _check_update_args(training_client, datums, settings)
    u, start = settings, time.perf_counter()
    if not datums:
        warnings.warn(NO_DATUMS, RuntimeWarning, stacklevel=2)
        return UpdateRecord.empty(u.adam.learning_rate)
    if u.bucket_by_length:
        datums = sorted(datums, key=lambda d: len(d.stream))
    summed = replace(u.loss, reduction="sum")
    bounds = np.linspace(0, len(datums), min(u.mini_batches, len(datums)) + 1).round().astype(int)
    outs, losses, steps = [], [], []
    for _ in range(u.epochs):
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            part = global_weights(datums[lo:hi], u.loss.reduction)
            futures = [training_client.forward_backward(part[i:i + u.minibatch], u.loss_fn,
                                                        summed)
                       for i in range(0, len(part), u.minibatch)]
            steps.append(training_client.optim_step(u.adam))
            done = [f.result() for f in futures]
            outs += done
            losses.append(sum(o.loss for o in done))
    total_tokens = sum(o.metrics["tokens"] for o in outs) or 1
    metrics = token_weighted([o.metrics for o in outs])
    metrics |= {"loss": float(np.mean(losses)), "tokens": total_tokens // u.epochs}
    opts = [s.result() for s in steps]
    return UpdateRecord(metrics, float(np.mean([o.grad_norm for o in opts])),
                        opts[-1].learning_rate, len(datums), time.perf_counter() - start)


TOKEN_WEIGHTED = ("kl_sampler_trainer", "clip_fraction", "entropy", "tis_truncated_fraction")
"""The per-token metrics of a forward(_backward) call that several calls average by tokens."""


def token_weighted(metrics: list[dict[str, float]]) -> dict[str, float]:
    """The TOKEN_WEIGHTED metrics the calls report (`ForwardBackwardOutput.metrics`), each the
    mean over all their tokens."""
    tokens = sum(m["tokens"] for m in metrics) or 1
    return {k: sum(m[k] * m["tokens"] for m in metrics) / tokens
            for k in TOKEN_WEIGHTED if k in metrics[0]}


def _check_update_args(training_client: Any, datums: Any, settings: Any) -> None:
    """update's arguments, each named in one line when it is not what update takes."""
    if not callable(getattr(training_client, "forward_backward", None)):
        raise TypeError(f"update takes a training client first (session.training_client), not "
                        f"{type(training_client).__name__}")
    if not isinstance(datums, list | tuple) or not all(isinstance(d, Datum) for d in datums):
        got = type(datums).__name__ if not isinstance(datums, list | tuple) else (
            f"a list holding {type(next(d for d in datums if not isinstance(d, Datum))).__name__}")
        raise TypeError(f"update takes datums, a list of Datum, not {got}: pass "
                        "make_datums(ro, adv)")
    _takes("update", settings, UpdateSettings, "settings, an UpdateSettings",
           "pass UpdateSettings(\"ppo\", LossConfig(), AdamParams(learning_rate=3e-4)) or "
           "schedule.step_update(config, step)")


@dataclass
class EvalRecord:
    """Greedy and sampled results on a fixed set (sampled over several passes)."""

    results: list[EvalResult]
    episodes: dict[str, list[list[Episode]]]
    seconds: float

    def by_mode(self, mode: str) -> EvalResult:
        return next(r for r in self.results if r.mode == mode)

    def __repr__(self) -> str:
        """One line: solved mazes per mode (episodes hold images: see `.episodes`)."""
        runs = ", ".join(f"{r.policy} {r.mode} {r.solved:.1f}/{r.n_mazes} solved"
                         + (f" ({r.episodes_per_maze} passes)" if r.episodes_per_maze > 1 else "")
                         for r in self.results)
        return f"EvalRecord({runs or 'no results'}, {self.seconds:.1f} s)"

    def _repr_html_(self) -> str:
        """The results as `rl.format_table`'s table."""
        head = "".join(f"<th>{h}</th>" for h in TABLE_HEADER.split())
        body = "".join(
            f"<tr><td>{html.escape(r.policy)}</td><td>{r.mode}</td><td>{r.solved:.1f}/"
            f"{r.n_mazes}</td><td>{100 * r.success_rate:.1f}%</td><td>{r.ceiling}/{r.n_mazes}"
            f"</td><td>{r.mean_turns:.2f}</td></tr>" for r in self.results)
        return f"<table><tr>{head}</tr>{body}</table>"


def evaluate(sampler: SamplingClient, batch: Batch, name: str = "policy",
             greedy: bool = True, keep_streams: bool = False) -> EvalRecord:
    """Success on a fixed set of a task (the batch's states): one greedy pass (when `greedy`)
    and the batch's G sampled passes (none when G is 0), each beside the task's ceiling
    (`Task.ceiling`). Episodes keep their replies and positions; token streams only with
    keep_streams."""
    _takes("evaluate", batch, Batch, "a Batch", "pass schedule.eval_batch(config), or "
           "Batch(task, eval_set(9, 8), G=2, params=SamplingParams(temperature=0.7), seed=0)")
    start = time.perf_counter()
    runs = [("greedy", replace(batch, G=1, params=replace(batch.params, temperature=0.0)))] \
        if greedy else []
    runs += [("sampled", batch)] if batch.G > 0 else []
    results, episodes = [], {}
    for mode, run in runs:
        eps = rollout(sampler, run).episodes_P_G
        if not keep_streams:  # token streams hold every image's pixels: ~1 MB a turn
            for ep in (ep for group in eps for ep in group):
                ep.stream, ep.turn_streams = None, []
        episodes[mode] = eps
        results.append(summarize(name, mode, eps, batch.states_P, batch.task))
    return EvalRecord(results, episodes, time.perf_counter() - start)
