"""Saving and loading session state: safetensors and JSON only, written atomically.

A state folder holds `adapter_model.safetensors` + `adapter_config.json` (PEFT format),
`optimizer.safetensors` (AdamW moments and step per parameter), `session.json` (base model,
its weights hash, LoRA settings, optimiser steps) and, written last, `COMPLETE`. Everything is
written into a temporary sibling folder that is renamed into place, so a folder without
`COMPLETE` is an interrupted write and is never loaded. Nothing is unpickled.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

if TYPE_CHECKING:
    from workbench.session.inprocess import ModelHost

SESSION_FILE = "session.json"
COMPLETE = "COMPLETE"


class IncompleteCheckpoint(RuntimeError):
    """A checkpoint folder without its completion marker or with missing files."""


def atomic_folder(final: Path, write: Callable[[Path], None]) -> Path:
    """Run write(tmp_folder), add the COMPLETE marker, then rename tmp -> final."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        write(tmp)
        (tmp / COMPLETE).write_text("ok\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def is_complete(folder: Path) -> bool:
    """True when the folder was fully written (its marker exists)."""
    return (Path(folder) / COMPLETE).is_file()


def _lora_dict(host: ModelHost) -> dict | None:
    return asdict(host.lora) if host.lora is not None else None


ADAPTER_FILE = "adapter_model.safetensors"
FULL_FILE = "trainable.safetensors"


def _write_adapter(host: ModelHost, folder: Path) -> None:
    """LoRA: PEFT's adapter_config.json + adapter_model.safetensors; full: trainable tensors."""
    if host.lora is None:
        tensors = {n: p.detach().cpu().contiguous() for n, p in host.trainable().items()}
        save_file(tensors, str(folder / FULL_FILE))
    else:
        host.lm.model.save_pretrained(str(folder))


def _set_weights(host: ModelHost, tensors: dict[str, torch.Tensor], folder: Path) -> None:
    from peft import set_peft_model_state_dict

    if host.lora is None:
        missing = set(host.trainable()) - set(tensors)
        if missing:
            raise ValueError(f"{folder} lacks weights for {sorted(missing)[:3]}")
        host.lm.model.load_state_dict(tensors, strict=False)
        return
    result = set_peft_model_state_dict(host.lm.model, tensors)
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"unexpected adapter keys in {folder}: {result.unexpected_keys[:3]}")


def export_model(host: ModelHost, folder: Path) -> Path:
    """A full checkpoint (LoRA merged) with its processor: a new base for load_model."""
    import copy

    from workbench.session.inprocess import _with_trainer_weights

    _with_trainer_weights(host)
    model = host.lm.model
    if host.lora is not None:
        model = copy.deepcopy(model).merge_and_unload()

    def write(tmp: Path) -> None:
        model.save_pretrained(str(tmp))
        host.lm.processor.save_pretrained(str(tmp))
    return atomic_folder(folder, write)


def export_adapter(host: ModelHost, folder: Path) -> Path:
    """The trainer's adapter in PEFT format (loads with PeftModel.from_pretrained)."""
    from workbench.session.inprocess import _with_trainer_weights

    _with_trainer_weights(host)

    def write(tmp: Path) -> None:
        _write_adapter(host, tmp)
        (tmp / "workbench_adapter.json").write_text(json.dumps({
            "base_model": host.lm.source, "base_weights_sha256": host.base_hash,
            "optimizer_steps": host.opt_steps, "lora": _lora_dict(host)}, indent=1))
    return atomic_folder(folder, write)


def _optimizer_tensors(host: ModelHost) -> tuple[dict[str, torch.Tensor], list[str]]:
    names = list(host.trainable())
    state = host.optimizer.state_dict()["state"]
    tensors = {}
    for idx, name in enumerate(names):
        for key, value in state.get(idx, {}).items():
            tensors[f"{name}::{key}"] = torch.as_tensor(value).detach().cpu().contiguous()
    return tensors, names


def save_state(host: ModelHost, folder: Path) -> Path:
    """Adapter + optimiser + session metadata, atomically."""
    from workbench.session.inprocess import _with_trainer_weights

    _with_trainer_weights(host)

    def write(tmp: Path) -> None:
        _write_adapter(host, tmp)
        tensors, names = _optimizer_tensors(host)
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        meta = {"model": host.lm.source, "base_weights_sha256": host.base_hash,
                "lora": _lora_dict(host), "optimizer_steps": host.opt_steps,
                "param_names": names}
        (tmp / SESSION_FILE).write_text(json.dumps(meta, indent=1))
    return atomic_folder(folder, write)


REQUIRED = (SESSION_FILE, "optimizer.safetensors")


def _read_state(folder: Path, host: ModelHost, with_optimizer: bool) -> dict:
    """Read and check every file of a state folder before anything is changed."""
    if not is_complete(folder):
        raise IncompleteCheckpoint(f"{folder} has no {COMPLETE} marker: not loading it")
    weights = FULL_FILE if host.lora is None else ADAPTER_FILE
    needed = [SESSION_FILE, weights] + (["optimizer.safetensors"] if with_optimizer else [])
    missing = [name for name in needed if not (folder / name).is_file()]
    if missing:
        raise IncompleteCheckpoint(f"{folder} lacks {missing}: not loading it")
    try:
        meta = json.loads((folder / SESSION_FILE).read_text())
        weights_T = load_file(str(folder / weights))
        optim_T = load_file(str(folder / "optimizer.safetensors")) if with_optimizer else None
    except Exception as err:  # truncated or corrupted files
        raise IncompleteCheckpoint(f"{folder} is unreadable ({type(err).__name__}: {err})") from err
    _check_compatible(meta, host, folder)
    return {"meta": meta, "weights": weights_T, "optimizer": optim_T}


def _check_compatible(meta: dict, host: ModelHost, folder: Path) -> None:
    if meta["base_weights_sha256"] != host.base_hash:
        raise ValueError(f"state {folder} was trained on base {meta['base_weights_sha256'][:12]}"
                         f" but this session's base is {host.base_hash[:12]}")
    if meta["lora"] != json.loads(json.dumps(_lora_dict(host))):  # JSON turns tuples to lists
        raise ValueError(f"state {folder} has LoRA settings {meta['lora']}, this session "
                         f"{_lora_dict(host)}")


def load_state(host: ModelHost, folder: Path, with_optimizer: bool = True) -> None:
    """Restore adapter weights (and optimiser state) from a complete state folder; nothing
    changes unless every file is present and readable."""
    from workbench.session.inprocess import _with_trainer_weights

    state = _read_state(Path(folder), host, with_optimizer)
    _with_trainer_weights(host)
    _set_weights(host, state["weights"], Path(folder))
    host.opt_steps = int(state["meta"]["optimizer_steps"])
    host.weights_id += 1
    if with_optimizer:
        _load_optimizer(host, state["optimizer"], state["meta"]["param_names"])


def _load_optimizer(host: ModelHost, tensors: dict[str, torch.Tensor], names: list[str]) -> None:
    current = list(host.trainable())
    if current != names:
        raise ValueError("optimizer state was saved for different trainable parameters")
    state = {}
    for idx, name in enumerate(names):
        entry = {key.split("::", 1)[1]: value for key, value in tensors.items()
                 if key.split("::", 1)[0] == name}
        if entry:
            state[idx] = entry
    full = host.optimizer.state_dict()
    full["state"] = state
    host.optimizer.load_state_dict(full)


def load_adapter_weights(host: ModelHost, folder: Path) -> None:
    """Load an exported PEFT adapter into the session's LoRA; refuses another base model and
    other LoRA settings."""
    from workbench.session.inprocess import _with_trainer_weights

    folder = Path(folder)
    if host.lora is None:
        raise ValueError("this session has no LoRA to load an adapter into")
    meta_file = folder / "workbench_adapter.json"
    if meta_file.exists():
        meta = json.loads(meta_file.read_text())
        if meta["base_weights_sha256"] != host.base_hash:
            raise ValueError(f"adapter {folder} was trained on base {meta['base_model']} "
                             f"({meta['base_weights_sha256'][:12]}), not on this session's base "
                             f"{host.lm.source} ({host.base_hash[:12]})")
    config = json.loads((folder / "adapter_config.json").read_text())
    if (config["r"], config["lora_alpha"]) != (host.lora.rank, host.lora.alpha):
        raise ValueError(f"adapter {folder} has rank/alpha {config['r']}/{config['lora_alpha']},"
                         f" this session {host.lora.rank}/{host.lora.alpha}")
    if config["target_modules"] != host.lora.target_regex:
        raise ValueError(f"adapter {folder} adapts {config['target_modules']!r}, this session "
                         f"{host.lora.target_regex!r} (lora.vision)")
    tensors = load_file(str(folder / ADAPTER_FILE))
    _with_trainer_weights(host)
    _set_weights(host, tensors, folder)
    host.weights_id += 1
