"""One way to open a session: a `SessionSpec` from a `RunConfig`, and the backend it names.

    spec = session_spec(config, "runs/grpo")       # model, dtype, device, LoRA, engine, speed,
    session = open_session(spec)                   # cluster: in-process, or actors on Ray

Train, SFT, eval, replay and the notebooks all open their sessions here, and the Ray actors build
their hosts from the same spec, so a setting honoured by one is honoured by all.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from workbench.config import ConfigError, RunConfig, build_record, knobs_moved
from workbench.model.load import model_name_problem
from workbench.session.protocols import SessionLike
from workbench.session.spec import SessionSpec

SPEC_FILE = "session_spec.json"


def session_spec(config: RunConfig, workdir: str | Path, full_finetune: bool = False,
                 model: str = "") -> SessionSpec:
    """The session a run of `config` opens in `workdir` (full_finetune: no LoRA, every weight
    trains, as SFT's sft.full_finetune; model: another base than model.name, e.g. a run's SFT
    model or an evaluated checkpoint). The records are the config's own sections, with what
    they leave to the run filled in: one image per turn and a KV pool of P x G rows."""
    engine, g = config.engine, config.generator
    return SessionSpec(
        model=model or config.model.name, lora=None if full_finetune else config.lora,
        workdir=str(workdir), dtype=config.model.dtype, device=config.model.device,
        engine=replace(engine, max_images=engine.max_images or g.max_turns, kv_rows=engine.kv_rows
                       or config.trainer.train_batch_size * g.n_samples_per_prompt),
        speed=config.speed,
        cluster=config.cluster)


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
    return build_record(SessionSpec, knobs_moved(data))
