"""The embedded default: a tiny Qwen3-VL with the real architecture, built locally.

`build_tiny(folder)` writes a complete checkpoint folder (config, safetensors weights, tokenizer,
image/video processor, chat template) with `save_pretrained`; `workbench.model.load_model` reads it
back through `AutoModelForImageTextToText` / `AutoProcessor`, the same path a real
Qwen/Qwen3-VL-8B-Instruct folder takes. Random init from a fixed seed: the build is deterministic
(the same bytes every time) and takes about a second.

Shape (~7.6 M parameters): text hidden 128, 2 layers, 4 heads, head_dim 32, M-RoPE sections
[4, 6, 6] interleaved (they must sum to head_dim / 2); vision depth 8, hidden 32, 2 heads, patch
16, spatial merge 9, no deepstack. A 9x9 maze (VisGym's easy size) drawn at 16 px a square is 9x9
patches, one patch a square: the vision tower attends over the 81 squares with 2D rotary
positions for 8 layers, and the merger concatenates all 81 (so the position of every square is
kept) into ONE image token per turn. The tokenizer makes the chat roles and the maze's fixed
phrases one token each (`model.tokenizer.phrases`), so a turn is 18 tokens.

Why one token per image: with one token per square (patch 16, merge 2 at 32 px, an earlier
default) the decoder must first find the agent's token among the squares before any wall near it
can matter, and a 2 M-parameter model learnt that search only after ~25,000 images; its SFT
policy ignored the image altogether. Merged into one token, the squares reach the decoder in fixed
slots of one vector. Why 8 narrow vision layers: on 9x9 the right move depends on which branch
dies within a few cells (a 3-cell look-ahead solves 45 of the 64 held-out mazes), and the depth-2
tower of the 7x7 default stayed at chance on 9x9 single-turn moves after 90,000 images where
depth 8 reached 68% (benchmarks/RESULTS.md, "What limits the tiny policy").
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from workbench.model.tokenizer import CHAT_TEMPLATE, build_tokenizer, phrases

TINY_NAME = "tiny"
TINY_SFT_NAME = "tiny-sft"  # the pretrained tiny policy (workbench.rl.pretrained builds it)


@dataclass(frozen=True)
class TinySpec:
    """Dimensions of the tiny Qwen3-VL; every field changes the build hash."""

    hidden: int = 128  # text hidden size (and the merger's output)
    layers: int = 2  # text decoder layers
    heads: int = 4  # text attention heads
    kv_heads: int = 4  # text KV heads (= heads: sdpa repeats GQA heads under a mask on CPU)
    head_dim: int = 32  # text head dim; mrope_section sums to head_dim / 2
    mrope_section: tuple[int, int, int] = (4, 6, 6)  # temporal, height, width rotary sections
    intermediate: int = 384  # text MLP width
    vision_hidden: int = 32  # vision tower width
    vision_heads: int = 2  # vision attention heads
    vision_depth: int = 8  # vision transformer blocks
    vision_intermediate: int = 64  # vision MLP width
    deepstack: tuple[int, ...] = ()  # vision layers fed into the first text layers
    vocab_size: int = 512  # BPE target size (the trained vocabulary may be smaller)
    phrase_tokens: bool = True  # the chat roles and VisGym's fixed phrases one token each
    patch: int = 16  # vision patch size in pixels (one 16 px maze square)
    merge: int = 9  # spatial merge: one image token per merge x merge patches (a 9x9 maze)
    min_pixels: int = 32 * 32  # processor lower bound (keeps small mazes at their own size)
    max_pixels: int = 512 * 512  # processor upper bound
    seed: int = 0  # weight init seed
    extra: dict = field(default_factory=dict)  # reserved for variants; part of the hash

    @property
    def build_hash(self) -> str:
        """Short hash naming the cache folder of this build."""
        text = repr(asdict(self)) + (repr(phrases()) if self.phrase_tokens else "")
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def qwen3vl_config(spec: TinySpec, tokenizer_ids: dict[str, int], vocab: int):
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
        hidden_size=spec.vision_hidden,
        intermediate_size=spec.vision_intermediate,
        num_heads=spec.vision_heads,
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


def tiny_processor(spec: TinySpec, fast_tokenizer):
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
    tok = build_tokenizer(spec.vocab_size, spec.phrase_tokens)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    config = qwen3vl_config(spec, tok.get_vocab(), tok.get_vocab_size())
    torch.manual_seed(spec.seed)
    model = Qwen3VLForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = tok.token_to_id("<|im_end|>")
    model.generation_config.pad_token_id = tok.token_to_id("<|endoftext|>")
    model.save_pretrained(folder)
    tiny_processor(spec, fast).save_pretrained(folder)
    (folder / "WORKBENCH_TINY.txt").write_text(f"tiny Qwen3-VL {spec.build_hash}\n{asdict(spec)}\n")
    return folder


def cache_root() -> Path:
    """Where built models live: $WORKBENCH_CACHE, else ~/.cache/workbench."""
    return Path(os.environ.get("WORKBENCH_CACHE", Path.home() / ".cache" / "workbench"))


def tiny_path(spec: TinySpec = TinySpec(), root: str | Path | None = None) -> Path:
    """The folder of the tiny default, built on first use (atomically: temp folder, rename)."""
    root = Path(root) if root is not None else cache_root()
    final = root / "models" / f"tiny-qwen3vl-{spec.build_hash}"
    if not (final / "WORKBENCH_TINY.txt").exists():
        build_atomically(final, lambda tmp: build_tiny(tmp, spec))
    return final


def build_atomically(final: Path, build: Callable[[Path], Any]) -> None:
    """Run build(tmp) into a temporary folder beside `final`, then rename it to `final`; a
    failed build leaves nothing. One build at a time per folder (a lock file beside it): a
    second process asking meanwhile waits, then finds the first's copy instead of repeating it."""
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if final.exists():
            return
        tmp = Path(tempfile.mkdtemp(prefix=f".building-{final.name}-", dir=final.parent))
        try:
            build(tmp)
            os.replace(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
