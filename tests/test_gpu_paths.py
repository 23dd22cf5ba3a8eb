"""The GPU code paths, checked on the CPU against the eager ones (CI never has a GPU).

- presets: Qwen3-VL-8B's config numbers and parameter count, from the config alone (no weights);
- pooled KV + static decode steps (what a CUDA graph replays) == the eager sampler;
- grouped-query decode attention == transformers' sdpa;
- lm_head on the loss tokens only == the full token_logprobs on those tokens;
- graph capture itself, and a whole GRPO step of the 8B shape, only where CUDA is.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from benchmarks.merge_precision import maze_prompts, rollout_like
from workbench.model import LoraSettings, add_lora
from workbench.model.presets import (
    QWEN3_VL_8B,
    QWEN3_VL_SMALL,
    build_random,
    lora_param_count,
    param_counts,
    shape_config,
)
from workbench.model.tokenizer import build_tokenizer
from workbench.policy import (
    chat_format,
)
from workbench.policy.forward import token_logprobs
from workbench.sampler.engine import TransformersEngine
from workbench.session import SpeedSettings

CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def small():
    """The small shape (real vocabulary, GQA 8 / 2), LoRA r8, float32 on the CPU."""
    lm = build_random("qwen3-vl-small-shape", dtype=torch.float32, device="cpu")
    lm.model = add_lora(lm.model, LoraSettings(rank=8, alpha=16)).eval()
    with torch.no_grad():  # non-zero B so the adapter changes the outputs
        for name, p in lm.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    return lm


def test_8b_preset_config_numbers_and_param_count() -> None:
    config = shape_config(QWEN3_VL_8B, build_tokenizer(512).get_vocab())
    t, v = config.text_config, config.vision_config
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads) == (4096, 36, 32)
    assert (t.num_key_value_heads, t.head_dim, t.intermediate_size) == (8, 128, 12288)
    assert t.vocab_size == 151936 and not config.tie_word_embeddings
    assert t.rope_parameters["mrope_section"] == [24, 20, 20]
    assert t.rope_parameters["rope_theta"] == 5_000_000.0
    assert (v.depth, v.hidden_size, v.intermediate_size, v.num_heads) == (27, 1152, 4304, 16)
    assert (v.patch_size, v.spatial_merge_size, v.out_hidden_size) == (16, 2, 4096)
    assert list(v.deepstack_visual_indexes) == [8, 16, 24]
    counts = param_counts(config)
    # 36 * (4096*128*(2*32 + 2*8) + 3*4096*12288) text matrices; 8.77 B in all
    assert counts["text_linear"] == 36 * (4096 * 128 * 80 + 3 * 4096 * 12288)
    assert abs(counts["total"] / 1e9 - 8.767) < 0.001
    assert lora_param_count(config, 32) == 87_293_952


def test_param_count_formula_matches_a_built_model(small) -> None:
    base = small.model.get_base_model()
    built = sum(p.numel() for n, p in base.named_parameters() if "lora_" not in n)
    assert param_counts(base.config)["total"] == built
    lora = sum(p.numel() for p in small.model.parameters() if p.requires_grad)
    assert lora == lora_param_count(base.config, 8)
    assert QWEN3_VL_SMALL.vocab == base.config.text_config.vocab_size


def test_preset_processor_uses_qwen3vl_pixel_bounds(small) -> None:
    prompts = maze_prompts(small)
    grids = [tuple(s.images[0].grid_thw.tolist()) for s in prompts]
    assert grids == [(1, 16, 16), (1, 18, 18)]  # 225 px -> 64 image tokens, 275 px -> 81


def test_static_pool_decode_matches_the_eager_sampler(small) -> None:
    from workbench.sampler.attention import use_gqa_decode_attention
    from workbench.sampler.graphs import GraphEngine, make_static_decode

    prompts = maze_prompts(small)
    eager = rollout_like(TransformersEngine(small), prompts, 2, 3, seed=7)
    static = make_static_decode(small.model, rows=2, capacity=64, bucket=32, use_graphs=False)
    try:
        use_gqa_decode_attention(small.model)
        pooled = rollout_like(GraphEngine(small, static), prompts, 2, 3, seed=7)
        again = rollout_like(GraphEngine(small, static), prompts, 2, 3, seed=7)  # pool reused
    finally:
        small.model.get_base_model().set_attn_implementation("sdpa")
    assert static.generation >= 2  # grew from 2 rows x 64 to the batch
    for a_turn, b_turn, c_turn in zip(eager, pooled, again):
        for a, b, c in zip(a_turn, b_turn, c_turn):
            assert a.tokens == b.tokens == c.tokens
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
            assert b.logprobs == c.logprobs


def test_a_closed_graph_engine_lets_go_of_its_pool(small) -> None:
    """close() drops the engine's KV pool (and with it the fused copy and captured graphs), as a
    session's close promises: nothing else keeps the pool's tensors alive."""
    import gc
    import weakref

    from workbench.sampler.graphs import GraphEngine, make_static_decode

    engine = GraphEngine(small, make_static_decode(small.model, rows=2, capacity=64, bucket=32,
                                                   use_graphs=False))
    rollout_like(engine, maze_prompts(small), 2, 1, seed=7)
    assert engine.static is not None
    pool = weakref.ref(engine.static.cache.layers[0]._k)
    engine.close()
    gc.collect()
    assert engine.static is None and pool() is None


@pytest.mark.parametrize("compiled", [False, True])
def test_fused_decode_matches_the_eager_sampler(small, compiled: bool) -> None:
    """Merged LoRA + fused projections + one function a layer (eager, or through torch.compile:
    inductor's CPU backend here, its CUDA backend on the H200) == transformers and peft."""
    from workbench.sampler.fused import layer_step
    from workbench.sampler.graphs import GraphEngine, make_static_decode

    prompts = maze_prompts(small)
    eager = rollout_like(TransformersEngine(small), prompts, 2, 3, seed=7)
    static = make_static_decode(small.model, rows=4, capacity=64, bucket=32, use_graphs=False,
                                fused=True, compiled=compiled)
    fused = rollout_like(GraphEngine(small, static), prompts, 2, 3, seed=7)
    assert static.fused.version is None and not static.compile_error
    assert (static.layer_step is not layer_step) == compiled  # no silent fall-back to eager
    for a_turn, b_turn in zip(eager, fused):
        for a, b in zip(a_turn, b_turn):
            assert a.tokens == b.tokens
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_a_failed_graph_capture_falls_back_with_one_warning_and_a_metric(small,
                                                                       monkeypatch) -> None:
    """A CUDA-graph capture that fails (the fault injected: the capture raises) runs the eager
    static step instead, one RuntimeWarning says why, and the host's speed/cuda_graphs is 0.0."""
    import warnings

    from workbench.sampler import graphs
    from workbench.sampler.graphs import GraphEngine, make_static_decode
    from workbench.session.host import speed_metrics

    def failing_capture(*args, **kwargs):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "_capture", failing_capture)
    monkeypatch.setattr(graphs.torch.cuda, "is_available", lambda: False)  # nothing to sync
    prompts = maze_prompts(small)
    eager = rollout_like(TransformersEngine(small), prompts, 2, 3, seed=7)
    static = make_static_decode(small.model, rows=4, capacity=64, bucket=32, use_graphs=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's default: once per place
        fallen = rollout_like(GraphEngine(small, static), prompts, 2, 3, seed=7)
    lines = [str(w.message) for w in caught if w.category is RuntimeWarning]
    assert lines == ["engine.cuda_graphs fell back to the slower path: RuntimeError: CUDA "
                     "error: operation not permitted when stream is capturing"]
    assert not static.use_graphs
    assert [[c.tokens for c in turn] for turn in fallen] == \
        [[c.tokens for c in turn] for turn in eager]
    host = SimpleNamespace(engine=SimpleNamespace(static=static), speed=SpeedSettings())
    assert {k: v for k, v in speed_metrics(host).items() if k.startswith("speed/")} == {
        "speed/cuda_graphs": 0.0}


def test_a_failing_compiled_decode_step_falls_back_with_one_warning(small) -> None:
    """A compiled layer step that raises (a compiler missing or failing) is replaced by the
    eager step once, with one RuntimeWarning; the samples are the eager ones."""
    import warnings

    from workbench.sampler.fused import layer_step
    from workbench.sampler.graphs import GraphEngine, make_static_decode
    from workbench.session.host import speed_metrics

    def broken(*args, **kwargs):
        raise RuntimeError("inductor: no C compiler")

    prompts = maze_prompts(small)
    eager = rollout_like(TransformersEngine(small), prompts, 2, 3, seed=7)
    static = make_static_decode(small.model, rows=4, capacity=64, bucket=32, use_graphs=False,
                                fused=True)
    static.layer_step, static.compiled = broken, True  # as if compiled, then failing
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        fallen = rollout_like(GraphEngine(small, static), prompts, 2, 3, seed=7)
    lines = [str(w.message) for w in caught if w.category is RuntimeWarning]
    assert lines == ["engine.compile_decode fell back to the slower path: "
                     "RuntimeError: inductor: no C compiler"]
    assert static.layer_step is layer_step
    assert [[c.tokens for c in turn] for turn in fallen] == \
        [[c.tokens for c in turn] for turn in eager]
    host = SimpleNamespace(engine=SimpleNamespace(static=static), speed=SpeedSettings())
    assert {k: v for k, v in speed_metrics(host).items() if k.startswith("speed/")} == {
        "speed/cuda_graphs": 0.0, "speed/compile_decode": 0.0}


def test_fused_weights_follow_the_sampler_version(small) -> None:
    """A new version re-merges the adapter in place: the decode step sees the new weights, and
    the fused tensors keep their addresses (captured graphs read them)."""
    from workbench.model.lora import merged_weight
    from workbench.sampler.fused import fuse_weights, refresh

    model = small.model
    layer = model.get_base_model().model.language_model.layers[0]
    fused = fuse_weights(model, version=0)
    address = fused.layers[0].qkv_QH.data_ptr()
    lora_B = layer.self_attn.q_proj.lora_B["default"].weight
    saved = lora_B.detach().clone()
    try:
        with torch.no_grad():
            lora_B.add_(0.5)
        refresh(fused, model, version=1)
        q_rows = merged_weight(layer.self_attn.q_proj).shape[0]
        torch.testing.assert_close(fused.layers[0].qkv_QH[:q_rows],
                                   merged_weight(layer.self_attn.q_proj))
        base = layer.self_attn.q_proj.base_layer.weight
        assert not torch.allclose(fused.layers[0].qkv_QH[:q_rows], base)
    finally:
        with torch.no_grad():
            lora_B.copy_(saved)
    assert fused.version == 1 and fused.layers[0].qkv_QH.data_ptr() == address
    # without adapters (peft's disable_adapter) the merged weight is the base weight itself
    with model.disable_adapter():
        assert merged_weight(layer.mlp.down_proj) is not None
        assert merged_weight(layer.mlp.down_proj).data_ptr() == \
            layer.mlp.down_proj.base_layer.weight.data_ptr()


def test_lora_in_model_dtype_keeps_the_gradients() -> None:
    """speed.lora_autocast on a bf16 base: the adapters see bf16 inputs (no float32 copies of
    the activations), their weights and gradients stay float32, and the gradients equal peft's
    float32 path within bf16 rounding."""
    from workbench.model.lora import lora_in_model_dtype

    lm = build_random("qwen3-vl-small-shape", dtype=torch.bfloat16, device="cpu")
    model = add_lora(lm.model, LoraSettings(rank=8, alpha=16))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    fmt, pad = chat_format(lm.processor), lm.processor.tokenizer.pad_token_id
    streams = maze_prompts(lm)
    q_proj = model.get_base_model().model.language_model.layers[0].self_attn.q_proj
    seen = []
    hook = q_proj.lora_A["default"].register_forward_pre_hook(
        lambda _, args: seen.append(args[0].dtype))

    def grads(on: bool) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with lora_in_model_dtype(model, on):
            logp, _ = token_logprobs(model, streams, 1.0, fmt.banned, pad)
            sum(lp[1:].float().sum() for lp in logp).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    try:
        full, mixed = grads(False), grads(True)
    finally:
        hook.remove()
    assert seen == [torch.float32, torch.bfloat16]
    assert all(g.dtype == torch.float32 for g in mixed.values())
    flat_full = torch.cat([g.flatten() for g in full.values()])
    flat_mixed = torch.cat([mixed[n].flatten() for n in full])
    assert float(flat_full.norm()) > 0
    assert float((flat_mixed - flat_full).norm() / flat_full.norm()) < 0.02
    assert float(torch.nn.functional.cosine_similarity(flat_mixed, flat_full, dim=0)) > 0.9995


def test_selective_checkpointing_keeps_the_gradients(small, monkeypatch) -> None:
    """speed.selective_checkpointing: the same loss and LoRA gradients as no checkpointing,
    and the policy keeps the base matmuls and attention but not LoRA's rank-r products."""
    from torch.utils.checkpoint import CheckpointPolicy

    from workbench.session import gpu
    from workbench.session.gpu import _keep_matmuls, set_checkpointing

    decisions = []
    monkeypatch.setattr(gpu, "_keep_matmuls",
                        lambda *a, **k: decisions.append(_keep_matmuls(*a, **k)) or decisions[-1])
    aten = torch.ops.aten
    x, w_in, w_rank = torch.ones(5, 96), torch.ones(96, 8), torch.ones(8, 96)
    assert _keep_matmuls(None, aten.mm.default, x, w_in) == CheckpointPolicy.MUST_SAVE
    assert _keep_matmuls(None, aten.mm.default, x[:, :8], w_rank) == \
        CheckpointPolicy.PREFER_RECOMPUTE
    assert _keep_matmuls(None, aten.mul.Tensor, x, x) == CheckpointPolicy.PREFER_RECOMPUTE
    fmt, pad = chat_format(small.processor), small.processor.tokenizer.pad_token_id
    streams = maze_prompts(small)
    model = small.model

    def loss_and_grads(checkpointing: bool) -> tuple[float, list[torch.Tensor]]:
        set_checkpointing(model, checkpointing, selective=True)
        model.train()
        model.zero_grad(set_to_none=True)
        try:
            logp, _ = token_logprobs(model, streams, 1.0, fmt.banned, pad)
            loss = sum(lp[1:].sum() for lp in logp)
            loss.backward()
        finally:
            model.eval()
            set_checkpointing(model, False)
        grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        model.zero_grad(set_to_none=True)
        return float(loss.detach()), grads

    plain = loss_and_grads(False)
    assert not decisions
    selective = loss_and_grads(True)
    assert CheckpointPolicy.MUST_SAVE in decisions  # the policy ran inside each layer
    assert CheckpointPolicy.PREFER_RECOMPUTE in decisions
    assert selective[0] == pytest.approx(plain[0], rel=1e-6)
    for a, b in zip(plain[1], selective[1]):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("queries", [1, 5])
def test_gqa_attention_matches_sdpa(queries: int) -> None:
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from workbench.sampler.attention import gqa_decode_attention

    g = torch.Generator().manual_seed(queries)
    q = torch.randn(3, 8, queries, 16, generator=g).transpose(1, 2).contiguous().transpose(1, 2)
    k, v = torch.randn(3, 2, 40, 16, generator=g), torch.randn(3, 2, 40, 16, generator=g)
    mask = torch.rand(3, 1, queries, 48, generator=g) > 0.3
    mask[:, :, :, 0] = True
    module = SimpleNamespace(num_key_value_groups=4, is_causal=True)
    ours, _ = gqa_decode_attention(module, q, k, v, mask, scaling=0.25)
    ref, _ = sdpa_attention_forward(module, q, k, v, mask[:, :, :, :40], scaling=0.25)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_loss_tokens_only_matches_full_logprobs(small) -> None:
    fmt = chat_format(small.processor)
    pad = small.processor.tokenizer.pad_token_id
    streams = maze_prompts(small)
    keep = [[t % 3 == 0 for t in range(len(s))] for s in streams]
    model = small.model
    model.train()
    try:
        full_lp, full_ent = token_logprobs(model, streams, 1.0, fmt.banned, pad)
        kept_lp, kept_ent = token_logprobs(model, streams, 1.0, fmt.banned, pad, keep)
        loss = sum(lp.sum() for lp in kept_lp)
        loss.backward()
    finally:
        model.eval()
        model.zero_grad(set_to_none=True)
    for f, k, fe, ke, m in zip(full_lp, kept_lp, full_ent, kept_ent, keep):
        m_T = torch.tensor(m)
        m_T[0] = False
        torch.testing.assert_close(k[m_T], f[m_T], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ke[m_T], fe[m_T], atol=1e-4, rtol=1e-4)
        assert bool((k[~m_T] == 0).all())


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("fused,compiled", [(False, False), (True, False), (True, True)])
def test_graph_decode_matches_eager_on_cuda(fused: bool, compiled: bool) -> None:
    from workbench.sampler.graphs import GraphEngine, make_static_decode

    lm = build_random("qwen3-vl-small-shape", dtype=torch.float32, device="cuda")
    lm.model = add_lora(lm.model, LoraSettings(rank=8, alpha=16)).eval()
    with torch.no_grad():
        for name, p in lm.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02, generator=torch.Generator("cuda").manual_seed(1))
    prompts = maze_prompts(lm)
    eager = rollout_like(TransformersEngine(lm), prompts, 2, 3, seed=3)
    static = make_static_decode(lm.model, rows=4, capacity=512, bucket=64, fused=fused,
                                compiled=compiled)
    graphed = rollout_like(GraphEngine(lm, static), prompts, 2, 3, seed=3)
    assert static.use_graphs and static.captures > 0, static.error
    assert not static.compile_error, static.compile_error
    for a_turn, b_turn in zip(eager, graphed):
        for a, b in zip(a_turn, b_turn):
            assert a.tokens == b.tokens
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-3)
