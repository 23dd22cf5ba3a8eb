"""Load a Qwen3-VL policy: the tiny default, the pretrained tiny policy, a local checkpoint folder,
or a hub id.

All go through `AutoModelForImageTextToText.from_pretrained` and `AutoProcessor.from_pretrained`,
so the tiny default exercises the real loading path. `"tiny"` builds the embedded default (random
weights) into the cache on first use (`workbench.model.tiny`); `"tiny-sft"` builds the pretrained
tiny policy from it (`workbench.model.pretrained` starts the build: an SFT recipe that
`workbench.rl.pretrained` runs in a child process). A hub id is
passed through unchanged (transformers resolves it); tests and CI only use folders.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import torch

from workbench.model.loaded import LoadedModel
from workbench.model.tiny import TINY_NAME, TINY_SFT_NAME, tiny_path

__all__ = ["LoadedModel", "load_model", "resolve_model_path", "weights_hash"]


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""What a hub id looks like: organisation/name, one slash, no path prefix."""


def model_name_problem(name: str) -> str:
    """"" when `name` can be loaded (tiny, tiny-sft, a shape of presets.SHAPES, an existing
    folder, or something shaped like a hub id), else the one-line reason: a path that does not
    exist is said to be one, instead of being sent to the hub as a repo id."""
    from workbench.model.presets import SHAPES

    if name in (TINY_NAME, TINY_SFT_NAME) or name in SHAPES or Path(name).expanduser().is_dir():
        return ""
    if Path(name).expanduser().exists():
        return f"{name} is a file, not a checkpoint folder"
    if HUB_ID.fullmatch(name) and not name.startswith((".", "~")):
        return ""
    return (f"no checkpoint folder {name} (model.name takes tiny, tiny-sft, a checkpoint folder "
            "or a hub id such as Qwen/Qwen3-VL-8B-Instruct)")


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
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
) -> LoadedModel:
    """Load model + processor from "tiny", a local folder, or a hub id; eval mode. A name of
    `workbench.model.presets.SHAPES` builds that shape with random weights on `device`."""
    from workbench.model.presets import SHAPES, build_random

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
    path = resolve_model_path(name_or_path)
    model = AutoModelForImageTextToText.from_pretrained(
        path, dtype=dtype, attn_implementation=attn_implementation
    ).to(device)  # type: ignore[arg-type]  # transformers types .to as @wraps(Module.to): unbound
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
