"""The embedded default: a tiny Qwen3-VL with the real architecture, built locally.

`build_tiny(folder)` writes a complete checkpoint folder (config, safetensors weights, tokenizer,
image/video processor, chat template) with `save_pretrained`; `workbench.model.load_model` reads it
back through `AutoModelForImageTextToText` / `AutoProcessor`, the same path a real
Qwen/Qwen3-VL-8B-Instruct folder takes. Random init from a fixed seed: the build is deterministic
(the same bytes every time) and takes about a second.

Shape (~2 M parameters): text hidden 128, 4 layers, 4 heads / 2 KV heads, head_dim 32, M-RoPE
sections [4, 6, 6] interleaved (they must sum to head_dim / 2); vision depth 2, hidden 128, patch
16, spatial merge 2. At 32 px a maze square, one merged 32x32 patch is one image token per square.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from workbench.model.tokenizer import CHAT_TEMPLATE, build_tokenizer

TINY_NAME = "tiny"


@dataclass(frozen=True)
class TinySpec:
    """Dimensions of the tiny Qwen3-VL; every field changes the build hash."""

    hidden: int = 128  # text and vision hidden size
    layers: int = 4  # text decoder layers
    heads: int = 4  # attention heads (text and vision)
    kv_heads: int = 4  # text KV heads (= heads: sdpa repeats GQA heads under a mask on CPU)
    head_dim: int = 32  # text head dim; mrope_section sums to head_dim / 2
    mrope_section: tuple[int, int, int] = (4, 6, 6)  # temporal, height, width rotary sections
    intermediate: int = 384  # text MLP width
    vision_depth: int = 2  # vision transformer blocks
    vision_intermediate: int = 256  # vision MLP width
    deepstack: tuple[int, ...] = (1,)  # vision layers fed into the first text layers
    vocab_size: int = 512  # BPE target size (the trained vocabulary may be smaller)
    patch: int = 16  # vision patch size in pixels
    merge: int = 2  # spatial merge: one image token per merge x merge patches
    min_pixels: int = 32 * 32  # processor lower bound (keeps small mazes at their own size)
    max_pixels: int = 512 * 512  # processor upper bound
    seed: int = 0  # weight init seed
    extra: dict = field(default_factory=dict)  # reserved for variants; part of the hash

    @property
    def build_hash(self) -> str:
        """Short hash naming the cache folder of this build."""
        return hashlib.sha256(repr(asdict(self)).encode()).hexdigest()[:12]


def _qwen3vl_config(spec: TinySpec, tokenizer_ids: dict[str, int], vocab: int):
    from transformers import Qwen3VLConfig

    text = dict(
        vocab_size=vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": list(spec.mrope_section),
            "mrope_interleaved": True,
        },
        pad_token_id=tokenizer_ids["<|endoftext|>"],
    )
    vision = dict(
        depth=spec.vision_depth,
        hidden_size=spec.hidden,
        intermediate_size=spec.vision_intermediate,
        num_heads=spec.heads,
        patch_size=spec.patch,
        spatial_merge_size=spec.merge,
        temporal_patch_size=2,
        out_hidden_size=spec.hidden,
        num_position_embeddings=1024,
        deepstack_visual_indexes=list(spec.deepstack),
    )
    return Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=tokenizer_ids["<|image_pad|>"],
        video_token_id=tokenizer_ids["<|video_pad|>"],
        vision_start_token_id=tokenizer_ids["<|vision_start|>"],
        vision_end_token_id=tokenizer_ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )


def _processor(spec: TinySpec, fast_tokenizer):
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    sizes = {"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels}
    common = dict(patch_size=spec.patch, merge_size=spec.merge, temporal_patch_size=2,
                  image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], size=sizes)
    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(**common),
        video_processor=Qwen3VLVideoProcessor(**common),
        tokenizer=fast_tokenizer,
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny(folder: str | Path, spec: TinySpec = TinySpec()) -> Path:
    """Build the tiny Qwen3-VL into `folder` (config, weights, tokenizer, processor)."""
    from transformers import PreTrainedTokenizerFast, Qwen3VLForConditionalGeneration

    folder = Path(folder)
    tok = build_tokenizer(spec.vocab_size)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    config = _qwen3vl_config(spec, tok.get_vocab(), tok.get_vocab_size())
    torch.manual_seed(spec.seed)
    model = Qwen3VLForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = tok.token_to_id("<|im_end|>")
    model.generation_config.pad_token_id = tok.token_to_id("<|endoftext|>")
    model.save_pretrained(folder)
    _processor(spec, fast).save_pretrained(folder)
    (folder / "WORKBENCH_TINY.txt").write_text(f"tiny Qwen3-VL {spec.build_hash}\n{asdict(spec)}\n")
    return folder


def cache_root() -> Path:
    """Where built models live: $WORKBENCH_CACHE, else ~/.cache/workbench."""
    return Path(os.environ.get("WORKBENCH_CACHE", Path.home() / ".cache" / "workbench"))


def tiny_path(spec: TinySpec = TinySpec(), root: str | Path | None = None) -> Path:
    """The folder of the tiny default, built on first use (atomically: temp folder, rename)."""
    root = Path(root) if root is not None else cache_root()
    final = root / "models" / f"tiny-qwen3vl-{spec.build_hash}"
    if (final / "WORKBENCH_TINY.txt").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=final.parent))
    try:
        build_tiny(tmp, spec)
        if final.exists():  # a concurrent build finished first; keep its copy
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
