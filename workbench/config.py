"""Run configuration: one frozen dataclass per concern, dotted overrides, presets.

Keys the seed quotes keep SkyRL's names and meanings (`generator.n_samples_per_prompt`,
`generator.max_turns`, `trainer.ckpt_interval`, `trainer.resume_mode`, `trainer.hf_save_interval`,
`trainer.eval_interval`, ...). Overrides are `section.key=value` strings:

    cfg = apply_overrides(PRESETS["tiny"], ["generator.max_turns=10", "lora.rank=16"])

An unknown key or a bad value raises ConfigError naming the key and the closest valid ones.
Each field's docstring (the string under it) is its help text: `python -m workbench train --help`.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import typing
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from workbench import loggers
from workbench.advantages import ADVANTAGES
from workbench.deps import require
from workbench.engines import ENGINES
from workbench.envs import GRAMMARS, REWARDS
from workbench.envs.env import OBSERVATIONS
from workbench.envs.protocol import Task
from workbench.envs.tasks import TASKS
from workbench.model.lora import LoraSettings
from workbench.policy.engine import EngineSettings
from workbench.session.losses import LOSSES, REDUCTIONS
from workbench.session.spec import ClusterSpec, SpeedSettings


class ConfigError(ValueError):
    """A configuration key or value that cannot be used."""


def check_loggers(spec: str) -> None:
    """ConfigError in one line when a logger of trainer.logger misses its package, naming the
    extra to install (`pip install 'workbench[mlflow]'`); call it before a run folder is touched."""
    for name in loggers.parse(spec):
        for module in loggers.needed_modules(name):
            try:
                require(module)
            except ImportError as err:
                raise ConfigError(f"trainer.logger={spec!r}: {err}") from None


@dataclass(frozen=True)
class ModelConfig:
    """The base model."""

    name: str = "tiny-sft"
    """"tiny-sft" (the pretrained tiny policy, built locally on first use), "tiny" (its random
    base), a checkpoint folder, or a hub id (Qwen/Qwen3-VL-8B-Instruct)."""
    dtype: str = "float32"
    """Weights dtype: float32 | bfloat16 | float16."""
    device: str = "cpu"
    """Torch device of the policy: cpu | cuda."""


@dataclass(frozen=True)
class EnvConfig:
    """The task (generator.max_turns sets the turn budget)."""

    task: str = "maze"
    """The task (envs/tasks.py): maze (VisGym's 2D maze) | room (an open room, walk to the goal;
    reward reach_goal only)."""
    size: int = 9
    """Maze side incl. the outer wall: 9 = VisGym's easy (the seed's task), 11 (hard), 7, 5."""
    px_per_cell: int = 16
    """Pixels per square: 25 = VisGym, 16 = one vision patch per square (the tiny default)."""
    grammar: str = "keyword"
    """Reply grammar: keyword (up/down/left/right/stop) | tuple (VisGym's ('move', d))."""
    reward: str = "reach_goal"
    """Reward rule: reach_goal | stop_on_goal (VisGym)."""
    format_weight: float = 0.0
    """Weight of the format term (SkyRL's recipe: 0.2)."""
    observation: str = "image"
    """What the model sees: image | ascii."""


@dataclass(frozen=True)
class GeneratorConfig:
    """Rollouts (SkyRL's generator.* keys)."""

    n_samples_per_prompt: int = 8
    """G: episodes sampled per maze (the group)."""
    max_turns: int = 15
    """Turn budget per episode."""
    temperature: float = 1.0
    """Sampling temperature of training rollouts."""
    max_tokens: int = 4
    """Reply length cap in tokens."""
    history_images: int = 0
    """Images kept in the model's context: 0 = every turn's; k > 0 = the last k turns keep their
    image and older turns keep only their text (VisGym's truncated history). With a window each
    turn's prompt is built anew, and the update trains one datum per turn: the prompt that turn
    was sampled from and its reply (`rl.rollout.play_model`, `rl.phases.make_datums`)."""


@dataclass(frozen=True)
class TrainerConfig:
    """The run: its length, batch, seed, checkpoints, exports, evaluations, resume and logs
    (SkyRL's trainer.* keys)."""

    total_steps: int = 40
    """GRPO steps (one rollout batch and one optimiser step each)."""
    train_batch_size: int = 8
    """P: mazes per step."""
    seed: int = 0
    """Seed of maze order and sampling."""
    ckpt_interval: int = 20
    """Full checkpoint (weights, optimiser, step, RNG states: what resume and replay start
    from) of step 0 before training and after every step that is a multiple of N; the last step
    only when it is one. 0 = never, step 0 included: such a run can be neither resumed nor
    replayed."""
    hf_save_interval: int = 20
    """PEFT adapter export (exports/global_step_N) after every step that is a multiple of N and
    after the last step. 0 = never, the last step included."""
    eval_interval: int = 10
    """Evaluation on the fixed set at step 0 (before training), after every step that is a
    multiple of N and after the last step. 0 = only at step 0 and after the last step."""
    resume_mode: str = "latest"
    """latest: continue from the newest intact checkpoint in run_dir (a damaged one is skipped
    for the one before); a fresh start when run_dir is empty or missing; refused when it holds
    a run but no intact checkpoint, unless trainer.overwrite. none: a new run; refused when
    run_dir (or its s3:// prefix) holds anything, unless trainer.overwrite. from_path: continue
    from the checkpoint at trainer.resume_path. Resuming refuses a config that differs from the
    checkpoint's in any key but total_steps, the intervals, keep_step_records, eval.*,
    cluster.*, storage.*, sft.*, run_dir and the memory settings (runfolder.RESUMABLE)."""
    resume_path: str = ""
    """Checkpoint folder for resume_mode=from_path."""
    overwrite: bool = False
    """Allow this start to delete what run_dir (or its s3:// prefix) holds, where it would
    otherwise be refused (resume_mode=none on a folder that is not empty; latest with no intact
    checkpoint; from_path into another run's folder). What is removed is listed in one line
    first. With resume_mode=latest it acts only when no intact checkpoint is left."""
    keep_step_records: bool = True
    """Keep each step's rollout and datums for replay."""
    logger: str = "jsonl"
    """Where metric rows go, comma-separated: jsonl (metrics.jsonl, always written even when
    not listed) | tensorboard (<run_dir>/tensorboard/; extra `tensorboard`) | mlflow (the run
    folder's mlflow.db, or $MLFLOW_TRACKING_URI; extra `mlflow`) | wandb (a W&B run, offline
    in <run_dir>/wandb/ without a key or a server, said in one line; extra `wandb`). E.g.
    jsonl,tensorboard: every row's numbers under the metrics.jsonl keys at its step
    (workbench/loggers.py)."""

    # The intervals as the fields above state them; `last` is the run's last step (default
    # total_steps). The loop acts on them, and `workbench.estimate` counts them.
    def eval_due(self, step: int, last: int | None = None) -> bool:
        """Whether an evaluation follows step `step` (>= 1): each multiple of eval_interval
        and the last step (step 0's is always run)."""
        end = self.total_steps if last is None else last
        return bool(self.eval_interval) and step % self.eval_interval == 0 or step == end

    def export_due(self, step: int, last: int | None = None) -> bool:
        """Whether an adapter export follows step `step`: each multiple of hf_save_interval
        and the last step; never when it is 0."""
        end = self.total_steps if last is None else last
        return bool(self.hf_save_interval) and (step % self.hf_save_interval == 0 or step == end)

    def checkpoint_due(self, step: int) -> bool:
        """Whether a full checkpoint follows step `step` (step 0 included): each multiple of
        ckpt_interval; never when it is 0."""
        return bool(self.ckpt_interval) and step % self.ckpt_interval == 0


@dataclass(frozen=True)
class AlgorithmConfig:
    """The update: policy loss, advantage estimator, optimiser and the batch it trains on (SkyRL:
    trainer.algorithm.*)."""

    loss: str = "ppo"
    """Policy loss: ppo | importance_sampling | cispo | cross_entropy."""
    loss_reduction: str = "sequence_mean"
    """sequence_mean (each episode weighs the same) | token_mean | sum. token_mean lets long
    failing episodes outweigh short successes, which unlearned the SFT policy in our runs."""
    clip_low: float = 0.2
    """PPO ratio floor 1 - clip_low."""
    clip_high: float = 0.2
    """PPO ratio ceiling 1 + clip_high."""
    advantage: str = "grpo"
    """grpo | dr_grpo | rloo | parity (for benchmarks only: +-1 by episode index, no signal)."""
    step_advantage: float = 0.0
    """Weight of GiGPO's step-level advantage added to each turn (0 = plain episode-level
    GRPO): turns taken from the same square within a maze's group are compared by their
    discounted return, so the move that wasted a turn scores below the one that did not."""
    step_gamma: float = 0.95
    """Discount of the step-level returns (gamma ** turns left * reward)."""
    learning_rate: float = 1e-4
    """Peak learning rate."""
    lr_schedule: str = "constant"
    """constant | warmup_cosine."""
    warmup_steps: int = 0
    """Linear warm-up steps (warmup_cosine)."""
    grad_clip_norm: float = 1.0
    """Global grad-norm clip (0 = off)."""
    minibatch: int = 16
    """Episodes per forward_backward call (gradient accumulation; does not change the update)."""
    mini_batches: int = 1
    """Optimizer steps per rollout batch: the batch's datums are split into this many
    mini-batches, each followed by an optim_step (SkyRL: train_batch_size /
    policy_mini_batch_size). Adam moves the weights about one learning rate per step whatever
    the batch holds, so more steps take more from each rollout; PPO's clip keeps the later
    steps near the sampler's policy."""
    update_epochs: int = 1
    """Passes over each rollout batch (SkyRL: update_epochs_per_batch)."""
    dynamic_sampling: int = 0
    """Refill rounds (DAPO's dynamic sampling): after a rollout, each group that carries no
    signal (every advantage zero: all solved or all failed alike) is dropped and a fresh
    training maze is rolled out in its place, for up to N more rounds, so the update trains on
    up to P groups that all carry signal. 0 = off: such groups cost their rollout and are left
    out of the update. Refill mazes and seeds are functions of the step and round
    (`rl.schedule.refill_mazes`), so a resumed run repeats them."""
    tis_cap: float = 0.0
    """Truncated importance sampling, for a sampler whose numerics differ from the trainer's
    (vLLM in bf16 beside speed.fp8_base): 0 = off; C >= 1 = the loss's ratio is taken against
    the trainer's own log-probs of the sampled tokens instead of the sampler's, and each token
    is weighted by min(trainer / sampler probability, C), no gradient through the weight
    (SkyRL: trainer.algorithm.tis_imp_ratio_cap). The mismatch then neither trips PPO's clip
    nor moves the gradient by more than C. The trainer's log-probs come from the update's own
    forward, so it needs one optimiser step per rollout (mini_batches=1, update_epochs=1); with
    off_policy_steps=1 the weight also carries the one step the weights moved since sampling."""
    off_policy_steps: int = 0
    """0: each step samples from the weights it then updates (on-policy). 1: the next step's
    rollout is sampled from the same weights as this step's, while this step's update runs
    (one step off-policy, as SkyRL's and PipelineRL's async trainers do; the PPO ratio is taken
    against the sampler's own log-probs). On Ray the two overlap: the engines are processes of
    their own. In-process they share the session's one worker and run one after the other (the
    run says so once). The step after a checkpoint samples on-policy again, so a resumed run
    repeats an uninterrupted one exactly."""


@dataclass(frozen=True)
class EvalConfig:
    """Evaluation on the fixed maze set."""

    n_mazes: int = 64
    """Mazes in the fixed set (eval seeds 0..n-1)."""
    greedy: bool = True
    """Evaluate greedy decoding."""
    sampled_passes: int = 2
    """Sampled passes per maze (64 episodes carry about +-6 points of noise)."""
    temperature: float = 0.7
    """Temperature of sampled evaluation (SkyRL's VisGym evaluation: 0.7)."""


@dataclass(frozen=True)
class SFTConfig:
    """The SFT baseline on oracle trajectories."""

    steps: int = 480
    """Optimiser steps."""
    batch_size: int = 8
    """Oracle episodes per step."""
    learning_rate: float = 5e-4
    """Peak learning rate (2e-3 stalled at chance on 9x9; 5e-4 and 1e-3 learnt)."""
    lr_schedule: str = "constant"
    """constant | cosine (from learning_rate to zero at the last step)."""
    full_finetune: bool = True
    """Train every weight (tiny default) instead of a LoRA adapter."""
    noise: float = 0.0
    """Chance of a random detour per turn (in context, not trained on): recovery examples."""
    overwrite: bool = False
    """Allow `sft` to delete a run_dir that is not empty (what is removed is listed in one line
    first); without it such a run_dir is refused and nothing is deleted."""


@dataclass(frozen=True)
class StorageConfig:
    """Where run directories and adapters live when they are on S3 (see README, "Storage")."""

    endpoint_url: str = ""
    """S3-compatible endpoint ("" = AWS_ENDPOINT_URL, else AWS); credentials and region come
    from the usual AWS settings, never from this config."""
    local_dir: str = ""
    """Working copy of an s3:// run_dir ("" = $WORKBENCH_CACHE/runs/<bucket>/<prefix>)."""


@dataclass(frozen=True)
class RunConfig:
    """A whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraSettings = field(default_factory=lambda: LoraSettings(vision=True))
    env: EnvConfig = field(default_factory=EnvConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    engine: EngineSettings = field(default_factory=lambda: EngineSettings(cuda_graphs=True))
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    speed: SpeedSettings = field(default_factory=SpeedSettings)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    storage: StorageConfig = field(default_factory=StorageConfig)
    run_dir: str = "runs/grpo"

    @property
    def task(self) -> Task:
        """The config of env.task (`envs.tasks.TASKS`) with the generator's turn budget."""
        settings = dataclasses.asdict(self.env) | {"max_turns": self.generator.max_turns}
        return TASKS[settings.pop("task")].make(settings)


CHOICES: dict[str, tuple[str, ...]] = {
    "model.dtype": ("float32", "bfloat16", "float16"),
    "env.task": tuple(TASKS),
    "env.grammar": tuple(GRAMMARS),
    "env.reward": tuple(REWARDS),
    "env.observation": OBSERVATIONS,
    "algorithm.lr_schedule": ("constant", "warmup_cosine"),
    "sft.lr_schedule": ("constant", "cosine"),
    "algorithm.loss": tuple(LOSSES),
    "algorithm.loss_reduction": tuple(REDUCTIONS),
    "algorithm.advantage": tuple(ADVANTAGES),
    "trainer.resume_mode": ("latest", "none", "from_path"),
    "cluster.strategy": ("ddp", "fsdp"),
    "engine.name": tuple(ENGINES),
    "engine.vllm_lora": ("adapter", "merged"),
}
"""Keys with a fixed set of values; those of a registry are read from it (grammars, rewards,
observations, losses, reductions, advantage estimators, sampler engines, tasks)."""


def _sections(config: RunConfig) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def flat_keys(config: RunConfig) -> dict[str, Any]:
    """Every dotted key with its current value."""
    out: dict[str, Any] = {}
    for name, value in _sections(config).items():
        if dataclasses.is_dataclass(value):
            out |= {f"{name}.{f.name}": getattr(value, f.name) for f in dataclasses.fields(value)}
        else:
            out[name] = value
    return out


def _coerce(key: str, raw: str, current: Any, kind: Any) -> Any:
    try:
        if typing.get_origin(kind) is tuple:  # tuple[str, ...]: comma-separated
            return tuple(item.strip() for item in raw.split(",") if item.strip())
        if kind is bool:
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1")
        return kind(raw)
    except ValueError:
        raise ConfigError(f"{key}={raw!r}: expected {kind.__name__} "
                          f"(current value {current!r})") from None


def _field_type(cls: type, name: str) -> Any:
    return typing.get_type_hints(cls)[name]


SAMPLER_KNOBS = ("cuda_graphs", "gqa_decode", "kv_rows", "kv_tokens", "bucket", "fused_decode",
                 "compile_decode")
"""Our sampler's knobs, once under `speed.*` and now the engine's: the old keys are accepted as
overrides (ALIASES) and in a saved config (`from_dict`)."""

ALIASES = {
    "trainer.placement.colocate_all": "cluster.colocate_all",
    "trainer.placement.policy_num_gpus_per_node": "cluster.num_workers",
    "generator.num_inference_engines": "cluster.num_engines",
    "generator.backend": "engine.name",
    "generator.gpu_memory_utilization": "engine.gpu_memory_utilization",
    "trainer.algorithm.advantage_estimator": "algorithm.advantage",
    "trainer.algorithm.loss_reduction": "algorithm.loss_reduction",
    "trainer.algorithm.eps_clip_low": "algorithm.clip_low",
    "trainer.algorithm.eps_clip_high": "algorithm.clip_high",
    "trainer.policy.optimizer_config.lr": "algorithm.learning_rate",
    "trainer.policy.optimizer_config.max_grad_norm": "algorithm.grad_clip_norm",
    "trainer.update_epochs_per_batch": "algorithm.update_epochs",
    "trainer.gradient_checkpointing": "speed.gradient_checkpointing",
    "trainer.fp8_base": "speed.fp8_base",
    "trainer.algorithm.tis_imp_ratio_cap": "algorithm.tis_cap",
} | {f"speed.{knob}": f"engine.{knob}" for knob in SAMPLER_KNOBS}
"""SkyRL's keys that live in another section here, accepted verbatim; the keys the seed quotes
under their SkyRL names (generator.n_samples_per_prompt, generator.max_turns,
trainer.ckpt_interval, trainer.resume_mode, trainer.hf_save_interval, trainer.eval_interval,
trainer.train_batch_size) are this config's own. The earlier `speed.<knob>` spellings of the
sampler's knobs (SAMPLER_KNOBS) map to `engine.<knob>`."""


def apply_overrides(config: RunConfig, overrides: list[str]) -> RunConfig:
    """Return config with each `section.key=value` applied; validates keys and values."""
    keys = flat_keys(config)
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip().removeprefix("--")
        key = ALIASES.get(key, key)
        if not sep:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        if key not in keys:
            close = difflib.get_close_matches(key, keys, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            section = key.split(".")[0]
            valid = [k for k in keys if k.startswith(section + ".")] or list(keys)
            raise ConfigError(f"unknown config key {key!r}{hint} (valid keys: {', '.join(valid)})")
        config = _replace(config, key, raw.strip())
        keys = flat_keys(config)
    validate(config)
    return config


def _replace(config: RunConfig, key: str, raw: str) -> RunConfig:
    if "." not in key:
        return dataclasses.replace(config, **{key: _coerce(key, raw, getattr(config, key), str)})
    section, name = key.split(".", 1)
    sub = getattr(config, section)
    value = _coerce(key, raw, getattr(sub, name), _field_type(type(sub), name))
    return dataclasses.replace(config, **{section: dataclasses.replace(sub, **{name: value})})


def validate(config: RunConfig) -> None:
    """Check choice-valued keys and value ranges; raise ConfigError naming the key."""
    values = flat_keys(config)
    for key, choices in CHOICES.items():
        if values[key] not in choices:
            close = difflib.get_close_matches(str(values[key]), choices, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{key}={values[key]!r} is not one of {list(choices)}{hint}")
    positive = ("generator.n_samples_per_prompt", "generator.max_turns", "generator.max_tokens",
                "trainer.train_batch_size", "algorithm.minibatch", "algorithm.mini_batches",
                "algorithm.update_epochs", "eval.n_mazes", "lora.rank",
                "cluster.num_workers", "cluster.num_engines")
    for key in positive:
        if values[key] < 1:
            raise ConfigError(f"{key} must be >= 1, got {values[key]}")
    for key, value in values.items():
        if isinstance(value, int | float) and not isinstance(value, bool) and value < 0:
            raise ConfigError(f"{key} must not be negative, got {value}")
    if (lag := values["algorithm.off_policy_steps"]) > 1:
        raise ConfigError("algorithm.off_policy_steps must be 0 (on-policy) or 1 (the next "
                          f"rollout overlaps this update), got {lag}")
    if (cap := values["algorithm.tis_cap"]) and cap < 1:
        raise ConfigError(f"algorithm.tis_cap must be 0 (off) or >= 1, got {cap}")
    if cap and (values["algorithm.mini_batches"], values["algorithm.update_epochs"]) != (1, 1):
        raise ConfigError("algorithm.tis_cap takes the trainer's log-probs of the sampled "
                          "tokens from the update's own forward, so the update must be one "
                          "optimiser step: set algorithm.mini_batches=1 and "
                          "algorithm.update_epochs=1")
    if values["generator.n_samples_per_prompt"] < 2:
        raise ConfigError("generator.n_samples_per_prompt must be >= 2 for group advantages")
    if values["engine.vllm_fp8"] and values["engine.name"] != "vllm":
        raise ConfigError("engine.vllm_fp8 quantises vLLM's weights: it needs engine.name=vllm, "
                          f"not {values['engine.name']!r}")
    _validate_cluster(config)
    try:
        loggers.parse(config.trainer.logger)
    except ValueError as err:
        raise ConfigError(f"trainer.logger={config.trainer.logger!r}: {err}") from None
    if values["trainer.resume_mode"] == "from_path" and not values["trainer.resume_path"]:
        raise ConfigError("trainer.resume_mode=from_path needs trainer.resume_path")
    try:
        _ = config.task  # the task's config validates size, px, grammar, reward
    except ValueError as err:
        raise ConfigError(f"env: {err}") from None


def _validate_cluster(config: RunConfig) -> None:
    address = config.cluster.address
    if address and address not in ("local", "auto") and ":" not in address:
        raise ConfigError(f"cluster.address={address!r}: use \"\" (in-process), \"local\", "
                          "\"auto\" or an address such as ray://127.0.0.1:10001")
    if config.cluster.cpus_per_actor <= 0:
        raise ConfigError("cluster.cpus_per_actor must be > 0")
    if config.cluster.threads_per_actor < 0:
        raise ConfigError("cluster.threads_per_actor must be >= 0 (0 = Ray's default)")
    if config.cluster.strategy == "fsdp" and config.model.device == "cpu":
        raise ConfigError("cluster.strategy=fsdp needs model.device=cuda (use ddp on CPU)")


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (read from its source), on one line."""
    tree = ast.parse(inspect.getsource(cls))
    body = typing.cast(ast.ClassDef, tree.body[0]).body  # getsource(cls): the class alone
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) \
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            target = typing.cast(ast.Name, node.target)  # a field: `name: type`
            docs[target.id] = " ".join(nxt.value.value.split())  # one line
    return docs


FP8_STORY = """\
FP8 is three keys, one story. speed.fp8_base puts the trainer's frozen base in FP8: the
update's text linear layers run FP8 matrix products (e4m3, row-wise scales) under the bf16
adapter, on a GPU of compute capability 8.9+ (elsewhere it falls back with one warning, and
speed/fp8_base logs 0). engine.vllm_fp8 puts the sampler's linear layers in FP8: vLLM's own
per-tensor quantisation, of each merged version as it arrives (engine.vllm_lora=merged) or of
the base once under bf16 LoRA kernels (adapter); it is refused without engine.name=vllm. Either
one makes the sampler's log-probs of the sampled tokens differ from the trainer's by FP8's
rounding, far more than bf16's, and PPO's ratio to the sampler then clips or weighs most reply
tokens by that error. algorithm.tis_cap=C (C >= 1; 2 in the measured runs) corrects for it: the
ratio is taken against the trainer's own log-probs and each token is weighed by min(trainer /
sampler probability, C). So use either FP8 key with algorithm.tis_cap: a run without says so in
one line. tis_cap needs one optimiser step per rollout (algorithm.mini_batches=1,
algorithm.update_epochs=1) and values below 1 are refused. SkyRL's spellings are accepted:
trainer.fp8_base, trainer.algorithm.tis_imp_ratio_cap."""
"""The FP8 keys together: what each does, what is refused, why tis_cap goes with them (the
CLI's --help ends with it; docs/configuration.md quotes it)."""


def describe_keys(config: RunConfig) -> str:
    """One line per dotted key: key=default  help."""
    lines = []
    for name, sub in _sections(config).items():
        if not dataclasses.is_dataclass(sub):
            lines.append(f"  {name}={sub}")
            continue
        cls: type = type(sub)  # `type`, not type[DataclassInstance]: mypy sees that as unhashable
        docs = field_docs(cls)
        for f in dataclasses.fields(sub):
            lines.append(f"  {name}.{f.name}={getattr(sub, f.name)}  {docs.get(f.name, '')}")
    return "\n".join(lines)


def to_dict(config: RunConfig) -> dict[str, Any]:
    """JSON-ready dict (tuples as lists)."""
    return json.loads(json.dumps(dataclasses.asdict(config)))


def build_record(cls: Any, data: dict[str, Any], where: str = "") -> Any:
    """The frozen dataclass `cls` from its dataclasses.asdict form read back from JSON: nested
    records rebuilt, lists back to tuples, values kept exactly; an unknown key raises
    ConfigError naming it, the closest keys and the valid ones."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        close = difflib.get_close_matches(unknown[0], names, n=3, cutoff=0.5)
        raise ConfigError(f"unknown config key {where}{unknown[0]}"
                          f" (closest: {', '.join(close) or 'none'}; "
                          f"valid: {', '.join(sorted(names))})")
    values = {}
    for name, value in data.items():
        kinds = [k for k in typing.get_args(hints[name]) if k is not type(None)] or [hints[name]]
        if isinstance(value, dict) and dataclasses.is_dataclass(kinds[0]):
            value = build_record(kinds[0], value, f"{where}{name}.")
        elif isinstance(value, list):
            value = tuple(value)
        values[name] = value
    return cls(**values)


def knobs_moved(data: dict[str, Any]) -> dict[str, Any]:
    """A saved config or session spec (asdict form) with the sampler's knobs that an older
    version kept under `speed` (SAMPLER_KNOBS) moved to `engine`, where they live now."""
    speed = dict(data.get("speed") or {})
    moved = {knob: speed.pop(knob) for knob in SAMPLER_KNOBS if knob in speed}
    if not moved:
        return data
    return data | {"speed": speed, "engine": dict(data.get("engine") or {}) | moved}


def from_dict(data: dict[str, Any]) -> RunConfig:
    """Inverse of to_dict (values kept exactly; a saved config of an older layout read through
    `knobs_moved`); unknown keys raise ConfigError."""
    config = build_record(RunConfig, knobs_moved(data))
    validate(config)
    return config


PRESETS: dict[str, RunConfig] = {
    "tiny": RunConfig(),
    # The seed's GPU recipe: Qwen3-VL-8B + LoRA 32, VisGym easy mazes, 8 samples, 15 turns,
    # checkpoints / exports every 20 steps, evaluation every 10 on the 64-maze set.
    "seed_gpu": RunConfig(
        model=ModelConfig(name="Qwen/Qwen3-VL-8B-Instruct", dtype="bfloat16", device="cuda"),
        lora=LoraSettings(rank=32, alpha=64, vision=False),
        env=EnvConfig(size=9, px_per_cell=25, grammar="tuple", reward="stop_on_goal",
                      format_weight=0.2),
        generator=GeneratorConfig(n_samples_per_prompt=8, max_turns=15, temperature=0.7,
                                  max_tokens=32),
        # Speed, measured on one H200 with the 8B shape (benchmarks/RESULTS.md, "A step"): vLLM
        # samples with the adapter merged into its weights in a 0.3 share beside the trainer;
        # bf16 LoRA, compiled layers, cuDNN's attention, no checkpointing at 4 episodes a call.
        # engine.name=transformers keeps our engine (compiled fused decode, CUDA graphs).
        engine=EngineSettings(name="vllm", gpu_memory_utilization=0.3, vllm_lora="merged",
                              cuda_graphs=True, compile_decode=True),
        speed=SpeedSettings(loss_tokens_only=True, lora_autocast=True, compile_layers=True,
                            cudnn_attention=True),
        trainer=TrainerConfig(total_steps=100, train_batch_size=8, ckpt_interval=20,
                              hf_save_interval=20, eval_interval=10),
        algorithm=AlgorithmConfig(learning_rate=1e-5, minibatch=4),
        eval=EvalConfig(n_mazes=64, greedy=True, sampled_passes=8, temperature=0.7),
        sft=SFTConfig(full_finetune=False, learning_rate=1e-5),
        run_dir="runs/seed_gpu",
    ),
}


def preset(name: str) -> RunConfig:
    """PRESETS[name], or a ConfigError naming the presets."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]
