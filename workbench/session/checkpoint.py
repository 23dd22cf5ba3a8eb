"""Saving and loading session state: safetensors and JSON only, written atomically, checksummed.

A state folder holds `adapter_model.safetensors` + `adapter_config.json` (PEFT format),
`optimizer.safetensors` (AdamW moments and step per parameter), `session.json` (base model,
its weights hash, LoRA settings, optimiser steps). Every folder written here (states, exports,
the loop's checkpoints) goes through `atomic_folder`: the files are written into a temporary
sibling folder, `SHA256SUMS.json` records the sha256 and size of each, `COMPLETE` (written
last) records the sha256 of that manifest, and the folder is renamed into place. A folder
without `COMPLETE` is an interrupted write and is never loaded; `verify_folder` names, in one
line, the first file that is missing, truncated or damaged. Nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from workbench.session.host import ModelHost, trainer_weights

SESSION_FILE = "session.json"
COMPLETE = "COMPLETE"
MANIFEST = "SHA256SUMS.json"  # {"files": {relative path: {"sha256": hex, "size": bytes}}}
INCOMPLETE = f"incomplete (no {COMPLETE} marker: an interrupted write)"  # a folder's problem
_MARKER = re.compile(r"ok(?: sha256=(?P<digest>[0-9a-f]{64}))?(?: (?:upload=)?[0-9a-f]{32})?")
"""COMPLETE's content: "ok sha256=<manifest's sha256>"; "ok" alone before checksums; an upload
to S3 appends its token (storage.put_folder)."""


class IncompleteCheckpoint(RuntimeError):
    """A checkpoint folder without its completion marker, or with a file missing, truncated or
    damaged (its message names which, in one line)."""


def atomic_folder(final: Path, write: Callable[[Path], None]) -> Path:
    """Run write(tmp_folder), record every file's sha256 in SHA256SUMS.json, add the COMPLETE
    marker (with the manifest's sha256), then rename tmp -> final."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        write(tmp)
        digest = write_checksums(tmp)
        (tmp / COMPLETE).write_text(f"ok sha256={digest}\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def atomic_write(path: Path, data: bytes) -> Path:
    """Write a file whole or not at all: into a temporary beside it, then renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path


def is_complete(folder: Path) -> bool:
    """True when the folder was fully written (its marker exists); `verify_folder` also checks
    every file against its recorded sha256."""
    return (Path(folder) / COMPLETE).is_file()


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes (read in 1 MiB chunks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_checksums(folder: Path) -> str:
    """Write SHA256SUMS.json for every file under `folder` (nested folders included; the
    top-level COMPLETE and the manifest itself excluded); returns the manifest's sha256."""
    folder = Path(folder)
    files = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_file() and rel not in (COMPLETE, MANIFEST):
            files[rel] = {"sha256": file_sha256(path), "size": path.stat().st_size}
    data = json.dumps({"files": files}, indent=1, sort_keys=True).encode()
    (folder / MANIFEST).write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def has_checksums(folder: Path) -> bool:
    """True when the folder carries a SHA256SUMS.json (folders written before checksums do
    not; `verify_folder` then checks only that JSON parses and safetensors are whole)."""
    return (Path(folder) / MANIFEST).is_file()


def verify_folder(folder: Path, required: tuple[str, ...] = ()) -> str:
    """The empty string when the folder is complete, every file matches SHA256SUMS.json and the
    `required` files are there; else the first problem in one line, e.g. "state/optimizer.
    safetensors is damaged (sha256 mismatch)", "trainer_state.json is truncated (100 of 1534
    bytes)", "state/session.json is missing", "incomplete (no COMPLETE marker: an interrupted
    write)". Files the manifest does not list (a registry's metadata) are not checked."""
    reason = _folder_reason(Path(folder))
    missing = (name for name in required if not (Path(folder) / name).is_file())
    return reason or next((f"{name} is missing" for name in missing), "")


def _folder_reason(folder: Path) -> str:
    if not folder.is_dir():
        return "missing (no such folder)"
    if not (folder / COMPLETE).is_file():
        return INCOMPLETE
    marker = _MARKER.fullmatch((folder / COMPLETE).read_bytes().decode("utf-8", "replace").strip())
    if marker is None:
        return f"{COMPLETE} is damaged (not a marker this code writes)"
    if not (folder / MANIFEST).is_file():
        if marker["digest"]:
            return f"{MANIFEST} is missing ({COMPLETE} records its sha256)"
        return _unchecked_reason(folder)
    raw = (folder / MANIFEST).read_bytes()
    if marker["digest"] and hashlib.sha256(raw).hexdigest() != marker["digest"]:
        return f"{MANIFEST} is damaged (its sha256 differs from the one {COMPLETE} records)"
    try:
        files = json.loads(raw)["files"]
        expected = {str(rel): (str(e["sha256"]), int(e["size"])) for rel, e in files.items()}
    except (ValueError, RecursionError, KeyError, TypeError, AttributeError):
        return f"{MANIFEST} is damaged (not a manifest of sha256 and size per file)"
    for rel, (_, size) in expected.items():  # cheap checks first: presence and size
        path = folder / rel
        if not path.is_file():
            return f"{rel} is missing"
        actual = path.stat().st_size
        if actual < size:
            return f"{rel} is truncated ({actual} of {size} bytes)"
        if actual != size:
            return f"{rel} is damaged ({actual} bytes, {size} expected)"
    for rel, (sha, _) in expected.items():
        if file_sha256(folder / rel) != sha:
            return f"{rel} is damaged (sha256 mismatch)"
    return ""


def _unchecked_reason(folder: Path) -> str:
    """A folder from before checksums: every .json parses and every .safetensors file is as
    long as its header says."""
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if not path.is_file():
            continue
        if path.suffix == ".json":
            try:
                json.loads(path.read_bytes())
            except (ValueError, RecursionError):
                return f"{rel} is damaged (not valid JSON)"
        elif path.suffix == ".safetensors":
            reason = _safetensors_reason(path)
            if reason:
                return f"{rel} {reason}"
    return ""


def _safetensors_reason(path: Path) -> str:
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 + n:
                return f"is truncated ({size} bytes, its header alone needs {8 + n})"
            header = json.loads(f.read(n))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
                  default=0)
    except (ValueError, RecursionError, KeyError, TypeError, AttributeError, IndexError):
        return "is damaged (not a safetensors file)"
    if size < 8 + n + end:
        return f"is truncated ({size} of {8 + n + end} bytes)"
    if size != 8 + n + end:
        return f"is damaged ({size} bytes, {8 + n + end} expected)"
    return ""


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
    result: Any = set_peft_model_state_dict(host.lm.model, tensors)  # peft: untyped result
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"unexpected adapter keys in {folder}: {result.unexpected_keys[:3]}")


def export_model(host: ModelHost, folder: Path) -> Path:
    """A full checkpoint (LoRA merged) with its processor: a new base for load_model. Refused
    on a trainer whose base is sharded (a Ray worker under strategy fsdp)."""
    import copy

    from torch.distributed.tensor import DTensor

    trainer_weights(host)
    model = host.lm.model
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise NotImplementedError('export(path, "model") under fsdp: export the "adapter" and '
                                  "merge it into the base on one device (load_model + "
                                  "load_adapter)")
    if host.lora is not None:
        model = copy.deepcopy(model).merge_and_unload()

    def write(tmp: Path) -> None:
        model.save_pretrained(str(tmp))
        host.lm.processor.save_pretrained(str(tmp))
    return atomic_folder(folder, write)


def export_adapter(host: ModelHost, folder: Path) -> Path:
    """The trainer's adapter in PEFT format (loads with PeftModel.from_pretrained)."""
    trainer_weights(host)

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
    trainer_weights(host)

    def write(tmp: Path) -> None:
        _write_adapter(host, tmp)
        tensors, names = _optimizer_tensors(host)
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        meta = {"model": host.lm.source, "base_weights_sha256": host.base_hash,
                "lora": _lora_dict(host), "optimizer_steps": host.opt_steps,
                "param_names": names}
        (tmp / SESSION_FILE).write_text(json.dumps(meta, indent=1))
    return atomic_folder(folder, write)


def _read_state(folder: Path, host: ModelHost, with_optimizer: bool) -> dict:
    """Read and check every file of a state folder before anything is changed."""
    reason = verify_folder(folder)
    if reason:
        raise IncompleteCheckpoint(f"{folder}: {reason}: not loading it")
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
    state = _read_state(Path(folder), host, with_optimizer)
    trainer_weights(host)
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
    other LoRA settings, and a folder of ours (it has COMPLETE) that fails `verify_folder`."""
    folder = Path(folder)
    if host.lora is None:
        raise ValueError("this session has no LoRA to load an adapter into")
    if is_complete(folder) or has_checksums(folder):  # a plain PEFT folder has neither
        reason = verify_folder(folder)
        if reason:
            raise IncompleteCheckpoint(f"adapter {folder}: {reason}: not loading it")
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
    trainer_weights(host)
    _set_weights(host, tensors, folder)
    host.weights_id += 1
