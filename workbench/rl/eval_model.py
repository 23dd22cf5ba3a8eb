"""Evaluate a model (and, optionally, a LoRA adapter) on a config's fixed set, in a session of
its own opened from the same spec a run of that config trains with (dtype, device, engine, speed,
cluster): `python -m workbench eval`, notebook 05 and the demo all come here.

    record = evaluate_model(config, "runs/sft/model", adapter="s3://bucket/adapters/maze-v1")
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from workbench.config import ConfigError, RunConfig
from workbench.model import LoraSettings
from workbench.opener import check_model, open_session, session_spec
from workbench.rl import phases
from workbench.rl.schedule import eval_batch


def adapter_settings(folder: str | Path) -> LoraSettings:
    """LoRA rank / alpha (and whether it adapts the vision tower) read from an adapter
    folder's adapter_config.json."""
    cfg = json.loads((Path(folder) / "adapter_config.json").read_text())
    return LoraSettings(rank=int(cfg["r"]), alpha=int(cfg["lora_alpha"]),
                        vision="visual" in str(cfg["target_modules"]))


def evaluate_model(config: RunConfig, model: str = "", adapter: str | Path = "",
                   name: str = "", log: Callable[[str], Any] = print) -> phases.EvalRecord:
    """Evaluate `model` (default model.name) plus an adapter (a folder or an s3:// URL of the
    registry; another base is refused by its weights hash) -> EvalRecord. The session is the
    one `session_spec(config)` describes, with the adapter's LoRA shape if there is one.
    Episodes are kept (without token streams) for galleries."""
    from workbench.registry import check_base, fetch_adapter, read_adapter_meta

    model = model or config.model.name
    check_model(model)
    folder = fetch_adapter(adapter, config.storage.endpoint_url) if adapter else None
    if folder is not None and not (Path(folder) / "adapter_config.json").is_file():
        raise ConfigError(f"adapter {adapter}: not an adapter folder (no adapter_config.json; "
                          "exports/global_step_N of a run, or s3://.../adapters/NAME)")
    workdir = Path(config.run_dir) / f"eval-{Path(str(adapter or model)).name}"
    spec = session_spec(config, workdir, model=model)
    if folder:  # the adapter's own shape (without one, the config's LoRA: zero-initialised B)
        spec = replace(spec, lora=adapter_settings(folder))
    session = open_session(spec, log)
    try:
        if folder:
            check_base(read_adapter_meta(folder), session.describe()["base_weights_sha256"],
                       model, str(adapter))
            session.training_client.load_adapter(folder).result()
        sampler = session.training_client.save_weights_and_get_sampling_client()
        return phases.evaluate(sampler, eval_batch(config), name or str(adapter or model),
                               config.eval.greedy)
    finally:
        session.close()
