"""One way to open a session: a `SessionSpec` from a `RunConfig`, and the backend it names.

    spec = session_spec(config, "runs/grpo")       # model, dtype, device, LoRA, engine, speed,
    session = open_session(spec)                   # cluster: in-process, or actors on Ray

Train, SFT, eval, replay and the notebooks all open their sessions here, and the Ray actors build
their hosts from the same spec, so a setting honoured by one is honoured by all.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from workbench.config import ConfigError, RunConfig
from workbench.model.load import model_name_problem
from workbench.model.lora import LoraSettings
from workbench.policy.engine import EngineSettings
from workbench.session.protocols import SessionLike
from workbench.session.spec import ClusterSpec, SessionSpec, SpeedSettings

SPEC_FILE = "session_spec.json"


def speed_settings(config: RunConfig) -> SpeedSettings:
    """trainer.gradient_checkpointing / selective_checkpointing / compile_layers /
    loss_tokens_only / share_prefix / lora_autocast and generator.cuda_graphs / fused_decode /
    compile_decode as one record; CUDA graphs only on a CUDA device with the transformers engine."""
    t, g = config.trainer, config.generator
    graphs = g.cuda_graphs and g.engine == "transformers" and config.model.device.startswith("cuda")
    return SpeedSettings(
        cuda_graphs=graphs, kv_rows=t.train_batch_size * g.n_samples_per_prompt,
        fused_decode=g.fused_decode, compile_decode=g.compile_decode,
        gradient_checkpointing=t.gradient_checkpointing,
        selective_checkpointing=t.selective_checkpointing, compile_layers=t.compile_layers,
        loss_tokens_only=t.loss_tokens_only, share_prefix=t.share_prefix,
        lora_autocast=t.lora_autocast)


def cluster_spec(config: RunConfig) -> ClusterSpec:
    """cluster.* with the trainer's and generator's actor counts and placement."""
    c = config.cluster
    return ClusterSpec(
        address=c.address, num_cpus=c.num_cpus, num_gpus=c.num_gpus, dashboard=c.dashboard,
        temp_dir=c.temp_dir, num_workers=config.trainer.num_workers,
        num_engines=config.generator.num_engines, colocate_all=config.trainer.colocate_all,
        strategy=config.trainer.strategy, cpus_per_actor=c.cpus_per_actor,
        threads_per_actor=c.threads_per_actor)


def session_spec(config: RunConfig, workdir: str | Path, full_finetune: bool = False,
                 model: str = "") -> SessionSpec:
    """The session a run of `config` opens in `workdir` (full_finetune: no LoRA, every weight
    trains, as SFT's sft.full_finetune; model: another base than model.name, e.g. a run's SFT
    model or an evaluated checkpoint)."""
    g = config.generator
    return SessionSpec(
        model=model or config.model.name,
        lora=None if full_finetune else config.lora.settings,
        workdir=str(workdir), dtype=config.model.dtype, device=config.model.device,
        engine=EngineSettings(g.engine, g.gpu_memory_utilization, max_images=g.max_turns,
                              max_model_len=g.max_model_len, vllm_lora=g.vllm_lora),
        speed=speed_settings(config), cluster=cluster_spec(config))


def check_model(name: str) -> None:
    """ConfigError in one line when model.name cannot be loaded (a path that does not exist),
    before a run folder is touched; hub ids are left to the hub."""
    problem = model_name_problem(name)
    if problem:
        raise ConfigError(f"model.name: {problem}")


def open_session(spec: SessionSpec, log: Callable[[str], Any] = print) -> SessionLike:
    """The backend the spec names: in-process when spec.cluster.address is "", else trainer and
    sampler actors on Ray (connecting first unless this process already is). The spec is
    written to <workdir>/session_spec.json: what this session was opened with."""
    write_spec(spec)
    if not spec.cluster.on_ray:
        from workbench.session.inprocess import create_session

        return create_session(spec)
    from workbench.cluster import connect, create_ray_session

    c = spec.cluster
    connect(c.address, c.num_cpus, c.num_gpus, c.dashboard, c.temp_dir or None, log=log)
    return create_ray_session(spec)


def write_spec(spec: SessionSpec) -> Path:
    """<workdir>/session_spec.json (read back with `read_spec`)."""
    path = Path(spec.workdir) / SPEC_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(spec), indent=1) + "\n")
    return path


def read_spec(workdir: str | Path) -> SessionSpec:
    """The SessionSpec a session in `workdir` was opened with."""
    data = json.loads((Path(workdir) / SPEC_FILE).read_text())
    return SessionSpec(model=data["model"], lora=LoraSettings.from_dict(data["lora"]),
                       workdir=data["workdir"],
                       dtype=data["dtype"], device=data["device"],
                       engine=EngineSettings(**data["engine"]),
                       speed=SpeedSettings(**data["speed"]), cluster=ClusterSpec(**data["cluster"]))

