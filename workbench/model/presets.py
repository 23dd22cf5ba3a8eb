"""Model shapes for GPU benchmarks: Qwen3-VL-8B's real architecture with random weights.

Nothing may be downloaded on the benchmark machine, and throughput does not depend on the weight
values, so `build_random(name, dtype, device)` builds the model from its config directly on the
device (no checkpoint folder: 17.5 GB of bf16 would take longer to write than to use). The numbers
are those of Qwen/Qwen3-VL-8B-Instruct's config.json (text: hidden 4096, 36 layers, 32 heads, 8 KV
heads, head_dim 128, MLP 12288, vocab 151936, M-RoPE sections [24, 20, 20] interleaved, rope theta
5e6, untied lm_head; vision: depth 27, hidden 1152, MLP 4304, 16 heads, patch 16, temporal patch 2,
spatial merge 2, 2304 position embeddings, out_hidden 4096, deepstack layers [8, 16, 24]), read
from copies of that file quoted in public repositories (a TensorRT-LLM Qwen3-VL test and a Swift
test fixture).

Tokenizer: the project's tiny byte-level BPE (a few hundred real tokens, all Qwen special tokens)
with the model's vocabulary padded to 151936, so the embedding and lm_head have the real size and
the real rollout code runs (ids above the tiny vocabulary decode to nothing, so a random model's
replies are unparseable and every episode runs all its turns: the longest episodes of the shape).
The image processor has Qwen3-VL's real settings (patch 16, merge 2, min_pixels 65536), so a
225 px easy maze becomes 64 image tokens and a 275 px hard maze 81.

    lm = load_model("qwen3-vl-8b-shape", dtype=torch.bfloat16, device="cuda")
    save_random("qwen3-vl-8b-shape", "/tmp/8b-shape")   # a folder, for vLLM
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from workbench.model.tiny import TinySpec, qwen3vl_config, tiny_processor


@dataclass(frozen=True)
class ShapeSpec:
    """A Qwen3-VL shape: TinySpec's fields plus the ones the 8B differs in."""

    spec: TinySpec  # dimensions shared with the tiny builder
    vocab: int  # embedding / lm_head rows (the tokenizer may be smaller)
    rope_theta: float = 5_000_000.0  # M-RoPE base
    tie_embeddings: bool = False  # the 8B has a separate lm_head
    num_position_embeddings: int = 2304  # vision learned position table


QWEN3_VL_8B = ShapeSpec(
    spec=TinySpec(
        hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, mrope_section=(24, 20, 20),
        intermediate=12288, vision_hidden=1152, vision_heads=16, vision_depth=27,
        vision_intermediate=4304, deepstack=(8, 16, 24), vocab_size=512, phrase_tokens=False,
        patch=16, merge=2,
        min_pixels=65536, max_pixels=16777216,
    ),
    vocab=151936,
)

# The same code path at a size a CPU runs in seconds (for CPU runs of benchmarks/gpu.py and
# tests): real vocabulary and GQA ratio, few and narrow layers.
QWEN3_VL_SMALL = ShapeSpec(
    spec=replace(QWEN3_VL_8B.spec, hidden=256, layers=2, heads=8, kv_heads=2, head_dim=32,
                 mrope_section=(4, 6, 6), intermediate=512, vision_hidden=128, vision_heads=4,
                 vision_depth=2, vision_intermediate=256, deepstack=(1,)),
    vocab=151936,
)

SHAPES: dict[str, ShapeSpec] = {
    "qwen3-vl-8b-shape": QWEN3_VL_8B,
    "qwen3-vl-small-shape": QWEN3_VL_SMALL,
}


def shape_config(shape: ShapeSpec, token_ids: dict[str, int]) -> Any:
    """The Qwen3VLConfig of a shape (token ids of the chat markup from the tokenizer)."""
    config = qwen3vl_config(shape.spec, token_ids, shape.vocab)
    text, vision = config.text_config, config.vision_config
    text.rope_parameters = {**text.rope_parameters, "rope_theta": shape.rope_theta}
    text.max_position_embeddings = 262144
    vision.out_hidden_size = shape.spec.hidden
    vision.num_position_embeddings = shape.num_position_embeddings
    vision.hidden_act = "gelu_pytorch_tanh"
    config.tie_word_embeddings = shape.tie_embeddings
    text.tie_word_embeddings = shape.tie_embeddings
    return config


def param_counts(config: Any) -> dict[str, int]:
    """Parameter counts from the config alone (no weights): the formulas the tests pin down.

    text linear = layers * (q + k + v + o + 3 MLP matrices); norms are the small rest."""
    t, v = config.text_config, config.vision_config
    d, hd, L = t.hidden_size, t.head_dim, t.num_hidden_layers
    attn = d * hd * (2 * t.num_attention_heads + 2 * t.num_key_value_heads)
    mlp = 3 * d * t.intermediate_size
    norms = L * (2 * d + 2 * hd) + d
    embed = t.vocab_size * d
    lm_head = 0 if config.tie_word_embeddings else t.vocab_size * d
    vd, vm, pd = v.hidden_size, v.intermediate_size, 3 * v.temporal_patch_size * v.patch_size**2
    block = 4 * vd * vd + 4 * vd + 2 * vd * vm + vm + vd + 4 * vd  # qkv+proj, fc1/fc2, 2 norms
    merged = vd * v.spatial_merge_size**2
    merger = merged * merged + merged + merged * v.out_hidden_size + v.out_hidden_size
    mergers = (1 + len(v.deepstack_visual_indexes)) * merger
    merger_norms = 2 * vd + len(v.deepstack_visual_indexes) * 2 * merged
    vision = (pd * vd + vd + v.num_position_embeddings * vd + v.depth * block + mergers
              + merger_norms)
    return {"text_linear": L * (attn + mlp), "text_norms": norms, "embed": embed,
            "lm_head": lm_head, "vision": vision,
            "total": L * (attn + mlp) + norms + embed + lm_head + vision}


def lora_param_count(config: Any, rank: int) -> int:
    """LoRA parameters on q, k, v, o, gate, up, down of every text layer: r * (in + out) each."""
    t = config.text_config
    d, hd, m = t.hidden_size, t.head_dim, t.intermediate_size
    q, kv = t.num_attention_heads * hd, t.num_key_value_heads * hd
    per_layer = (d + q) + 2 * (d + kv) + (q + d) + 2 * (d + m) + (m + d)
    return rank * per_layer * t.num_hidden_layers


def build_random(name: str, dtype: torch.dtype = torch.bfloat16,
                 device: str | torch.device = "cpu", seed: int = 0) -> Any:
    """A LoadedModel of shape `name` with random weights, built directly on `device`."""
    from transformers import PreTrainedTokenizerFast, Qwen3VLForConditionalGeneration

    from workbench.model.loaded import LoadedModel
    from workbench.model.tokenizer import CHAT_TEMPLATE, build_tokenizer

    shape = SHAPES[name]
    tok = build_tokenizer(shape.spec.vocab_size, shape.spec.phrase_tokens)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token=None, model_max_length=262144,
    )
    fast.chat_template = CHAT_TEMPLATE
    config = shape_config(shape, tok.get_vocab())
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3VLForConditionalGeneration._from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = tok.token_to_id("<|im_end|>")
    model.generation_config.pad_token_id = tok.token_to_id("<|endoftext|>")
    processor = tiny_processor(shape.spec, fast)
    return LoadedModel(model=model.eval(), processor=processor, source=name, path=name)


def save_random(name: str, folder: str | Path, dtype: torch.dtype = torch.bfloat16,
                device: str | torch.device = "cpu") -> str:
    """The random weights of shape `name` saved as a checkpoint folder, for what loads only from
    disk (vLLM); a folder that already holds a config.json is kept as it is. -> the folder."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        lm = build_random(name, dtype, device)
        lm.model.save_pretrained(folder, max_shard_size="5GB")
        lm.processor.save_pretrained(folder)
        del lm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return str(folder)
