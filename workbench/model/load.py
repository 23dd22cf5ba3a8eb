"""Load a Qwen3-VL policy: the tiny default, the pretrained tiny policy, a local checkpoint folder,
or a hub id.

All go through `AutoModelForImageTextToText.from_pretrained` and `AutoProcessor.from_pretrained`,
so the tiny default exercises the real loading path. `"tiny"` builds the embedded default (random
weights) into the cache on first use (`workbench.model.tiny`); `"tiny-sft"` builds the pretrained
tiny policy from it (`workbench.model.pretrained` starts the build: an SFT recipe that
`workbench.rl.pretrained` runs in a child process). A hub id is passed through unchanged
(transformers resolves it) once it is known to load without the hub's minute of retries: it is
in the local Hugging Face cache, or the hub answers one request within HUB_TIMEOUT seconds.
With HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set, or the hub unreachable, an id that is not
cached is refused in one line. Tests and CI only use folders.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import warnings
from pathlib import Path

import torch

from workbench.model.loaded import LoadedModel
from workbench.model.tiny import TINY_NAME, TINY_SFT_NAME, tiny_path

__all__ = ["LoadedModel", "load_model", "resolve_model_path", "weights_hash"]


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""What a hub id looks like: organisation/name, one slash, no path prefix."""


def model_name_problem(name: str) -> str:
    """"" when `name` can be loaded (tiny, tiny-sft, a shape of presets.SHAPES, an existing
    folder, or a hub id that `hub_problem` passes), else the one-line reason: a path that does
    not exist is said to be one, instead of being sent to the hub as a repo id."""
    from workbench.model.presets import SHAPES

    if name in (TINY_NAME, TINY_SFT_NAME) or name in SHAPES or Path(name).expanduser().is_dir():
        return ""
    if Path(name).expanduser().exists():
        return f"{name} is a file, not a checkpoint folder"
    if HUB_ID.fullmatch(name) and not name.startswith((".", "~")):
        return hub_problem(name)
    return (f"no checkpoint folder {name} (model.name takes tiny, tiny-sft, a checkpoint folder "
            "or a hub id such as Qwen/Qwen3-VL-8B-Instruct)")


HUB_TIMEOUT = 3.0
"""Seconds the one reachability check of the hub may take (DNS included; no retries)."""


def hub_offline() -> str:
    """The variable that puts the hub offline ("HF_HUB_OFFLINE" or "TRANSFORMERS_OFFLINE", read
    as huggingface_hub reads them: 1, ON, YES or TRUE), or "" when online."""
    var = "HF_HUB_OFFLINE" if os.environ.get("HF_HUB_OFFLINE") else "TRANSFORMERS_OFFLINE"
    return var if os.environ.get(var, "").upper() in ("1", "ON", "YES", "TRUE") else ""


def hub_cached(repo_id: str) -> str:
    """The repo's snapshot folder in the local Hugging Face cache (HF_HUB_CACHE) when that holds
    its config.json (revision main), else ""."""
    from huggingface_hub import try_to_load_from_cache

    config = try_to_load_from_cache(repo_id, "config.json")
    return str(Path(config).parent) if isinstance(config, str) else ""


def hub_reachable(endpoint: str = "", timeout: float = HUB_TIMEOUT) -> bool:
    """Whether the hub (`endpoint`, default HF_ENDPOINT) answers one HEAD request within
    `timeout` seconds, name lookup included: huggingface_hub's own calls retry a failed
    request five times with backoff (about 25 s a file), this asks once. Any HTTP status counts
    as an answer; proxies are huggingface_hub's."""
    from huggingface_hub import constants, get_session

    answered: list[bool] = []

    def head() -> None:
        try:
            get_session().head(endpoint or constants.ENDPOINT, timeout=timeout)
            answered.append(True)
        except Exception:  # refused, unknown host, timeout, TLS, offline mode: no answer
            pass

    thread = threading.Thread(target=head, daemon=True)  # a stuck name lookup is left behind
    thread.start()
    thread.join(timeout)
    return bool(answered)


def hub_problem(repo_id: str) -> str:
    """"" when hub id `repo_id` can load now (cached, or the hub answers), else the one-line
    reason, found without retries: offline, the id must be in the local cache; online and not
    cached, the hub must answer `hub_reachable`."""
    from huggingface_hub import constants

    if hub_cached(repo_id):
        return ""
    offline = hub_offline()
    missing = (f"{repo_id} is neither a checkpoint folder nor in the local Hugging Face cache "
               f"({constants.HF_HUB_CACHE})")
    if offline:
        return (f"{missing}, and {offline} is set: point model.name at a checkpoint folder, "
                f"or download {repo_id} where the hub is reachable")
    if not hub_reachable():
        return (f"{missing}, and the hub ({constants.ENDPOINT}) could not be reached: point "
                "model.name at a checkpoint folder, or download it where the hub is reachable "
                "and set HF_HUB_OFFLINE=1")
    return ""


def _cached_folder(name: str) -> str:
    """A hub id's snapshot folder in the local cache when the hub is offline, or does not
    answer (a warning says so), so the load asks the hub nothing: transformers would retry it
    file by file for a minute (its adapter lookup even with local_files_only). Else `name`
    (a Path, which callers pass too, is a local folder, never a hub id)."""
    if not isinstance(name, str):
        return name
    folder = hub_cached(name) if HUB_ID.fullmatch(name) and not Path(name).is_dir() else ""
    if not folder or (not hub_offline() and hub_reachable()):
        return name
    if not hub_offline():
        warnings.warn(f"the Hugging Face hub could not be reached: loading {name} from the local"
                      " cache (set HF_HUB_OFFLINE=1 to skip this check)", RuntimeWarning,
                      stacklevel=3)
    return folder


def resolve_model_path(name_or_path: str) -> str:
    """Map "tiny" and "tiny-sft" to their built folders (building them on first use); return
    folders and hub ids unchanged."""
    if name_or_path == TINY_NAME:
        return str(tiny_path())
    if name_or_path == TINY_SFT_NAME:
        from workbench.model.pretrained import tiny_sft_path

        return str(tiny_sft_path())
    return name_or_path


def load_model(
    name_or_path: str = TINY_NAME,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
) -> LoadedModel:
    """Load model + processor from "tiny", a local folder, or a hub id; eval mode. A name of
    `workbench.model.presets.SHAPES` builds that shape with random weights on `device`.
    `dtype` is a torch dtype or its name as model.dtype writes it ("bfloat16"). Device "meta":
    the model's structure from its config, no weights read (a sampler that holds its weights
    elsewhere, e.g. vLLM's own copy)."""
    from workbench.model.presets import SHAPES, build_random

    if isinstance(dtype, str):
        named = getattr(torch, dtype, None)
        if not isinstance(named, torch.dtype):
            raise ValueError(f"dtype {dtype!r} is not a torch dtype (float32, bfloat16, float16)")
        dtype = named

    problem = model_name_problem(name_or_path)
    if problem:
        raise FileNotFoundError(problem)
    if name_or_path in SHAPES:
        lm = build_random(name_or_path, dtype=dtype, device=device)
        lm.model.set_attn_implementation(attn_implementation)
        return lm
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = _cached_folder(resolve_model_path(name_or_path))
    if str(device) == "meta":
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path)
        config._attn_implementation = attn_implementation
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    else:
        model = AutoModelForImageTextToText.from_pretrained(
            path, dtype=dtype, attn_implementation=attn_implementation
        ).to(device)  # type: ignore[arg-type]  # transformers types .to as @wraps(Module.to)
    processor = AutoProcessor.from_pretrained(path)
    return LoadedModel(model=model.eval(), processor=processor, source=name_or_path, path=path)


def weights_hash(model: torch.nn.Module) -> str:
    """sha256 over parameter names, shapes and bytes: identifies a base model's weights."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def folder_hash(folder: str | Path) -> str:
    """sha256 over the files of a checkpoint folder (names and bytes), for build determinism."""
    digest = hashlib.sha256()
    for file in sorted(Path(folder).rglob("*")):
        if file.is_file():
            digest.update(file.relative_to(folder).as_posix().encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()
