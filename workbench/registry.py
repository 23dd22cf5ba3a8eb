"""The adapter registry: published LoRA adapters with their metadata, and the serving default.

    python -m workbench adapters publish runs/grpo/exports/global_step_40 --name maze-v1 \\
        --store s3://bucket/workbench
    python -m workbench adapters list     --store s3://bucket/workbench
    python -m workbench adapters promote maze-v1 --store s3://bucket/workbench
    python -m workbench adapters rollback --store s3://bucket/workbench

Layout under a store (a local folder or s3://bucket/prefix):

    adapters/<name>/adapter_config.json, adapter_model.safetensors   PEFT (vLLM / Ray Serve LLM)
    adapters/<name>/workbench_adapter.json   base model id and base-weights sha256 (the export's)
    adapters/<name>/registry.json            name, base, run, step, eval results, publish time
    adapters/<name>/COMPLETE                 written last: a torn upload is never listed as usable
    serving.json                             {"default": name, "history": [older defaults]}

`adapters/` is what Ray Serve LLM's `dynamic_lora_loading_path` points at, so the same folders
serve on GPUs. An adapter refuses a base whose weights hash differs from the one it was trained
on (`check_base`), naming both hashes.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from workbench import storage
from workbench.runfolder import EXPORTS, step_of
from workbench.storage import Store

ADAPTERS = "adapters"
SERVING = "serving.json"
META = "registry.json"
EXPORT_META = "workbench_adapter.json"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class RegistryError(ValueError):
    """A registry operation that cannot be done (bad name, unknown adapter, no rollback)."""


class ForeignBaseError(ValueError):
    """An adapter trained on another base model's weights."""


@dataclass(frozen=True)
class AdapterEntry:
    """One published adapter, as `registry.json` records it."""

    name: str
    base_model: str  # the base model id the run trained on ("tiny", a folder, a hub id)
    base_weights_sha256: str  # workbench.model.weights_hash of that base
    run: str = ""  # the run directory it was exported from
    step: int | None = None  # the training step of the export
    eval: dict[str, dict[str, float]] = field(default_factory=dict)  # mode -> summary
    lora: dict[str, Any] = field(default_factory=dict)  # rank, alpha, ...
    published_at: str = ""  # UTC, ISO 8601
    default: bool = False  # the serving default now (from serving.json, not stored)

    def row(self) -> str:
        """One line of `adapters list`."""
        evals = "  ".join(f"{m} {v['solved']:.1f}/{v['n_mazes']} ({100 * v['success_rate']:.1f}%)"
                          for m, v in self.eval.items()) or "no eval"
        step = "-" if self.step is None else str(self.step)
        return (f"{'*' if self.default else ' '} {self.name:<20} step {step:>5}  {evals}  "
                f"base {self.base_model} ({self.base_weights_sha256[:12]})")


def check_name(name: str) -> str:
    """Adapter names: letters, digits, '.', '_', '-' (no ':', which separates base:adapter)."""
    if not NAME_RE.match(name):
        raise RegistryError(f"adapter name {name!r} must match {NAME_RE.pattern} "
                            "(no ':' or '/': clients call '<base>:<adapter>')")
    return name


def check_base(adapter_meta: dict[str, Any], base_hash: str, base_name: str, where: str) -> None:
    """Refuse an adapter whose base-weights hash is not `base_hash`, naming both hashes."""
    trained = adapter_meta.get("base_weights_sha256", "")
    if trained and base_hash and trained != base_hash:
        raise ForeignBaseError(
            f"adapter {where} was trained on base {adapter_meta.get('base_model', '?')} "
            f"(weights sha256 {trained}) and cannot be loaded onto base {base_name} "
            f"(weights sha256 {base_hash}): load it onto the model it was trained on")


def read_adapter_meta(folder: str | Path) -> dict[str, Any]:
    """workbench_adapter.json of an adapter folder ({} for a plain PEFT folder)."""
    path = Path(folder) / EXPORT_META
    return json.loads(path.read_text()) if path.is_file() else {}


def eval_summary(results: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """mode -> solved / n_mazes / success_rate / ceiling / mean_turns, from eval/step_N.json."""
    out = {}
    for r in results:
        per_pass = sum(r["successes_P"]) / r["episodes_per_maze"]
        out[r["mode"]] = {"solved": per_pass, "n_mazes": r["n_mazes"],
                          "success_rate": per_pass / r["n_mazes"], "ceiling": r["ceiling"],
                          "mean_turns": r["mean_turns"]}
    return out


def _run_and_step(export: str) -> tuple[str, int | None]:
    """<run>/exports/global_step_N -> (<run>, N); ("", None) for another layout."""
    parent, _, leaf = export.rstrip("/").rpartition("/")
    run, _, exports = parent.rpartition("/")
    step = step_of(leaf)
    if exports != EXPORTS or step is None:
        return "", None
    return run if storage.is_s3(run) else str(Path(run or ".").resolve()), step


def _run_eval(run: str, step: int | None, endpoint_url: str) -> dict[str, dict[str, float]]:
    """Eval summary of <run>/eval/step_N.json ({} when there is none)."""
    if not run or step is None:
        return {}
    store, key = storage.open_store(run, endpoint_url), f"eval/step_{step:06d}.json"
    if not storage.exists(store, key):
        return {}
    return eval_summary(storage.read_json(store, key)["results"])


def publish(store: Store, export: str | Path, name: str, run: str = "", step: int | None = None,
            eval_results: dict[str, dict[str, float]] | None = None, overwrite: bool = False,
            cache: Path | None = None) -> AdapterEntry:
    """Copy an exported adapter (a local folder or s3://...) to adapters/<name>/ with its
    metadata; run, step and eval results are read from <run>/exports/global_step_N when not
    given. Refuses an existing name unless overwrite."""
    check_name(name)
    if not overwrite and storage.folder_complete(store, f"{ADAPTERS}/{name}"):
        raise RegistryError(f"adapter {name!r} is already published in {store.root} "
                            "(pass overwrite=True / --overwrite to replace it)")
    folder = fetch_adapter(export, store.endpoint_url, cache)
    if not storage.is_s3(export) and not (folder / storage.COMPLETE).is_file():
        raise storage.IncompleteUpload(f"{folder} has no {storage.COMPLETE} marker: not an "
                                       "export that finished writing")
    meta = read_adapter_meta(folder)
    if not meta or not (folder / "adapter_config.json").is_file():
        raise RegistryError(f"{export} is not a workbench adapter export (it needs "
                            f"adapter_config.json and {EXPORT_META})")
    inferred_run, inferred_step = _run_and_step(str(export))
    run, step = run or inferred_run, inferred_step if step is None else step
    if eval_results is None:
        eval_results = _run_eval(run, step, store.endpoint_url)
    entry = AdapterEntry(
        name=name, base_model=meta["base_model"], base_weights_sha256=meta["base_weights_sha256"],
        run=run, step=step, eval=eval_results,
        lora=meta.get("lora") or {}, published_at=time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                 time.gmtime()))
    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / name
        shutil.copytree(folder, staged)
        record = {k: v for k, v in asdict(entry).items() if k != "default"}
        (staged / META).write_text(json.dumps(record, indent=1))
        storage.put_folder(store, f"{ADAPTERS}/{name}", staged)
    return entry


def serving_state(store: Store) -> dict[str, Any]:
    """{"default": name or None, "history": [previous defaults, newest last]}."""
    if not storage.exists(store, SERVING):
        return {"default": None, "history": []}
    return storage.read_json(store, SERVING)


def get_adapter(store: Store, name: str) -> AdapterEntry:
    """The registry entry of a published adapter (RegistryError if unknown or torn)."""
    if not storage.folder_complete(store, f"{ADAPTERS}/{check_name(name)}"):
        known = ", ".join(list_names(store)) or "none"
        raise RegistryError(f"no adapter {name!r} in {store.root}/{ADAPTERS} (published: {known})")
    record = storage.read_json(store, f"{ADAPTERS}/{name}/{META}")
    return AdapterEntry(**record, default=serving_state(store)["default"] == name)


def list_names(store: Store) -> list[str]:
    """Names of the complete adapters in the store."""
    return [n for n in storage.list_dir(store, ADAPTERS)
            if NAME_RE.match(n) and storage.folder_complete(store, f"{ADAPTERS}/{n}")]


def list_adapters(store: Store) -> list[AdapterEntry]:
    """Every complete adapter with its metadata and eval results; torn uploads are left out."""
    default = serving_state(store)["default"]
    out = []
    for name in list_names(store):
        record = storage.read_json(store, f"{ADAPTERS}/{name}/{META}")
        out.append(AdapterEntry(**record, default=name == default))
    return out


def promote(store: Store, name: str) -> dict[str, Any]:
    """Make `name` the serving default; the previous default goes on the history."""
    get_adapter(store, name)  # must exist and be complete
    state = serving_state(store)
    if state["default"] == name:
        return state
    history = state["history"] + ([state["default"]] if state["default"] else [])
    state = {"default": name, "history": history, "updated_at": _now()}
    storage.write_json(store, SERVING, state)
    return state


def rollback(store: Store) -> dict[str, Any]:
    """Restore the previous serving default (RegistryError when there is none)."""
    state = serving_state(store)
    if not state["history"]:
        raise RegistryError(f"nothing to roll back to in {store.root}: no previous default "
                            f"(the default is {state['default']!r})")
    state = {"default": state["history"][-1], "history": state["history"][:-1],
             "updated_at": _now()}
    storage.write_json(store, SERVING, state)
    return state


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def adapter_cache(cache: str | Path | None = None) -> Path:
    """Where downloaded adapters are kept: `cache`, else $WORKBENCH_CACHE/adapters."""
    if cache:
        return Path(cache)
    from workbench.model.tiny import cache_root

    return cache_root() / "adapters"


def fetch_adapter(source: str | Path, endpoint_url: str = "",
                  cache: str | Path | None = None) -> Path:
    """A local adapter folder for a local path or an s3://.../adapters/<name> URL (downloaded
    into the cache once per upload; a torn upload is refused)."""
    if not storage.is_s3(source):
        return Path(source)
    parent, _, name = str(source).rstrip("/").rpartition("/")
    return storage.cached_folder(storage.open_store(parent, endpoint_url), name,
                                 adapter_cache(cache))
