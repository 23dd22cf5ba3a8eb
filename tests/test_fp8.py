"""speed.fp8_base (`workbench.session.fp8`): the FP8 GEMMs' arithmetic on the CPU (torch's
`_scaled_mm` runs there too), the policy's log-probs and LoRA gradients against bf16's, the
fallback a CPU run reports, and the compiled CUDA path where a GPU is."""

from __future__ import annotations

import warnings

import pytest
import torch

from workbench.config import PRESETS, apply_overrides
from workbench.model import LoraSettings, add_lora
from workbench.model.presets import build_random
from workbench.policy import append_user, chat_format, encode_image, start_stream
from workbench.policy.forward import token_logprobs
from workbench.session.fp8 import (
    E4M3_MAX,
    Fp8Linear,
    drop_fp8_base,
    fp8_linear,
    fp8_mm,
    fp8_unsupported,
    frozen_linears,
    quantize_rows,
    quantize_weight,
    use_fp8_base,
)

CUDA = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _logprobs_and_lora_grads(model, streams, processor) -> tuple[torch.Tensor, torch.Tensor]:
    """The streams' token log-probs (their first token left out) with grad, and the LoRA
    gradient of their sum, flattened."""
    fmt, pad = chat_format(processor), processor.tokenizer.pad_token_id
    model.zero_grad(set_to_none=True)
    logp, _ = token_logprobs(model, streams, 1.0, fmt.banned, pad)
    flat = torch.cat([lp[1:].float() for lp in logp])
    flat.sum().backward()
    return flat.detach(), torch.cat([p.grad.flatten().float() for p in model.parameters()
                                     if p.requires_grad])


def _dequantized(x_q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x_q.float() * scale


def test_quantize_rows_keeps_each_row_within_e4m3s_rounding() -> None:
    """Each row's largest magnitude maps to e4m3's largest value, 448, and every element comes
    back within e4m3's half-step (2^-4 relative) or its smallest subnormal step of the row's
    scale; a column scale multiplies in before the row scale is taken."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=gen) * torch.logspace(-2, 2, 32)[:, None]
    x_q, scale_M1 = quantize_rows(x)
    assert x_q.dtype == torch.float8_e4m3fn and scale_M1.shape == (32, 1)
    assert torch.equal(x_q.float().abs().amax(dim=1), torch.full((32,), E4M3_MAX))
    err = (_dequantized(x_q, scale_M1) - x).abs()
    assert bool((err <= x.abs() * 2**-4 + scale_M1 * 2**-10).all())
    cols = torch.rand(1, 64, generator=gen) + 0.5
    y_q, y_scale = quantize_rows(x, cols)
    assert bool(((_dequantized(y_q, y_scale) - x * cols).abs()
                 <= (x * cols).abs() * 2**-4 + y_scale * 2**-10).all())


def test_fp8_matmul_is_the_dequantized_product_forward_and_backward() -> None:
    """fp8_mm's output is the product of the dequantised input and weight (bf16 rounding),
    its input gradient the dequantised (gradient x weight scales) times the FP8 weight; both
    within e4m3's error of the exact bf16 product; the frozen weight gets no gradient."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(48, 64, generator=gen).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(32, 64, generator=gen) / 8).to(torch.bfloat16)
    g = torch.randn(48, 32, generator=gen).to(torch.bfloat16)
    weight = quantize_weight(w)
    y = fp8_mm(x, weight)
    (y * g).sum().backward()
    x_q, x_scale = quantize_rows(x.detach())
    w_deq = _dequantized(weight.w_NK, weight.scale_1N.reshape(-1, 1))
    assert y.dtype == torch.bfloat16 and y.shape == (48, 32)
    assert torch.allclose(y.float(), _dequantized(x_q, x_scale) @ w_deq.T, rtol=1e-2, atol=1e-2)
    g_q, g_scale = quantize_rows(g, weight.scale_1N)
    assert torch.allclose(x.grad.float(), _dequantized(g_q, g_scale) @ weight.w_NK.float(),
                          rtol=1e-2, atol=1e-2)
    exact_y, exact_dx = x.detach().float() @ w.float().T, g.float() @ w.float()
    assert float((y.detach().float() - exact_y).norm() / exact_y.norm()) < 0.06
    assert float((x.grad.float() - exact_dx).norm() / exact_dx.norm()) < 0.06


def test_fp8_linear_pads_rows_and_keeps_leading_dimensions() -> None:
    """A (2, 5, 64) input (10 rows: padded to 16 inside) gives (2, 5, 32), each row the same as
    it is alone, plus the bias."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 5, 64, generator=gen).to(torch.bfloat16)
    weight = quantize_weight((torch.randn(32, 64, generator=gen) / 8).to(torch.bfloat16))
    bias = torch.randn(32, generator=gen).to(torch.bfloat16)
    y = fp8_linear(x, weight, bias)
    assert y.shape == (2, 5, 32)
    assert torch.equal(y[1, 3], fp8_linear(x[1, 3:4], weight, bias)[0])


@pytest.fixture(scope="module")
def bf16_lora():
    """The small shape in bf16 with a LoRA r8 whose B is non-zero, and two maze prompts."""
    from workbench.envs import MazeConfig, MazeEnv, system_prompt
    from workbench.rl import user_text

    lm = build_random("qwen3-vl-small-shape", dtype=torch.bfloat16, device="cpu")
    model = add_lora(lm.model, LoraSettings(rank=8, alpha=16))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    fmt = chat_format(lm.processor)
    streams = []
    for k, size in enumerate((9, 11)):
        config = MazeConfig(size=size, px_per_cell=25)
        obs, info = MazeEnv(config).reset(seed=k)
        stream = start_stream(lm.processor, fmt, system_prompt(config))
        streams.append(append_user(stream, lm.processor, fmt, user_text(obs, info, config),
                                   encode_image(lm.processor, obs["image"])))
    return lm, model, streams


def test_fp8_base_keeps_the_policys_log_probs_and_lora_gradients(bf16_lora) -> None:
    """use_fp8_base on the small shape: every frozen projection of every text layer (q, k, v,
    o, gate, up, down) is switched and nothing trainable; with grad, the token log-probs stay
    within 0.1 nats (median 0.02) of bf16's and the LoRA gradients point the same way (cosine >
    0.98); without grad the outputs are bf16's exactly; drop_fp8_base restores the layers."""
    lm, model, streams = bf16_lora
    fmt, pad = chat_format(lm.processor), lm.processor.tokenizer.pad_token_id
    layers = model.get_base_model().model.language_model.layers

    def run(grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        model.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(grad):
            logp, _ = token_logprobs(model, streams, 1.0, fmt.banned, pad)
            flat = torch.cat([lp[1:].float() for lp in logp])
            if not grad:
                return flat, None
            flat.sum().backward()
        return flat.detach(), torch.cat([p.grad.flatten().float() for p in model.parameters()
                                         if p.requires_grad])

    bf16_logp, bf16_grad = run(True)
    bf16_nograd, _ = run(False)
    try:
        assert use_fp8_base(model) == 7 * len(layers) == len(frozen_linears(model))
        assert use_fp8_base(model) == 7 * len(layers)  # idempotent: nothing quantised twice
        assert not any("fp8" in key for key in model.state_dict())  # saves see bf16 only
        fp8_logp, fp8_grad = run(True)
        fp8_nograd, _ = run(False)
    finally:
        drop_fp8_base(model)
    finite = bf16_logp.isfinite()  # the image's placeholder tokens are banned: -inf in both
    assert torch.equal(fp8_logp.isfinite(), finite) and int(finite.sum()) > 100
    gap = (fp8_logp - bf16_logp)[finite].abs()
    assert 0 < float(gap.median()) < 0.02 and float(gap.max()) < 0.1
    assert float(torch.nn.functional.cosine_similarity(fp8_grad, bf16_grad, dim=0)) > 0.98
    assert torch.equal(fp8_nograd[finite], bf16_nograd[finite])
    assert all(type(m) is torch.nn.Linear and not list(m.buffers())
               for m in frozen_linears(model))
    assert torch.equal(run(True)[0][finite], bf16_logp[finite])


def test_fp8_base_on_a_cpu_falls_back_saying_why(bf16_lora) -> None:
    """The key (and its SkyRL-style alias) reaches the host; on a CPU the host says once why it
    falls back, runs bf16, and its speed metric shows 0."""
    from workbench.opener import session_spec
    from workbench.session.host import make_host, speed_metrics

    lm, model, _ = bf16_lora
    assert fp8_unsupported(model) == "FP8 GEMMs need a CUDA GPU (the model is on cpu)"
    config = apply_overrides(PRESETS["tiny"], ["trainer.fp8_base=true", "lora.rank=4",
                                               "model.name=tiny"])
    assert config.speed.fp8_base
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        host = make_host(session_spec(config, "runs/unused"), sampler=False)
    lines = [str(w.message) for w in caught if "fp8" in str(w.message)]
    assert lines == ["speed.fp8_base fell back to the slower path: FP8 GEMMs need a CUDA GPU "
                     "(the model is on cpu)"]
    assert not host.fp8_base and speed_metrics(host)["speed/fp8_base"] == 0.0
    assert not any(isinstance(m, Fp8Linear) for m in frozen_linears(host.lm.model))


def test_compiled_layers_trace_the_fp8_path_as_one_graph(bf16_lora,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """With speed.compile_layers the FP8 layers go through torch.compile: dynamo traces every
    decoder layer, its seven FP8 GEMMs included (custom ops beside traced quantisations), into
    one graph with no break, and its log-probs and LoRA gradients are the eager FP8 path's. The
    graph runs through AOTAutograd without inductor here (`aot_eager`: the CPU has no FP8
    kernels to generate); on CUDA inductor compiles it (the test below)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from workbench.session.gpu import compile_for_training

    lm, _, streams = bf16_lora
    model = add_lora(build_random("qwen3-vl-small-shape", dtype=torch.bfloat16,
                                  device="cpu").model, LoraSettings(rank=8, alpha=16))
    use_fp8_base(model)
    eager = _logprobs_and_lora_grads(model, streams, lm.processor)
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend="aot_eager", **kw))
    torch._dynamo.reset()
    counters.clear()
    compile_for_training(model)
    compiled = _logprobs_and_lora_grads(model, streams, lm.processor)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    finite = eager[0].isfinite()
    assert torch.equal(compiled[0][finite], eager[0][finite])
    rel = float((compiled[1] - eager[1]).norm() / eager[1].norm())
    print(f"compiled vs eager LoRA gradients: relative difference {rel:.2g}")
    assert rel < 1e-4  # AOTAutograd's decomposed backward sums in another order


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU with FP8 tensor cores (8.9+)")
def test_fp8_base_compiled_equals_eager_on_cuda() -> None:
    """On the GPU: the compiled quantisation and a compiled layer give the eager FP8 path's
    log-probs and LoRA gradients within FP8's own error (inductor's fused quantisation can round
    an element to the neighbouring e4m3 value: the two FP8 paths may differ by as much as FP8
    differs from bf16, no more), and both stay near bf16's as on the CPU."""
    from workbench.session.gpu import compile_for_training

    lm = build_random("qwen3-vl-small-shape", dtype=torch.bfloat16, device="cuda")
    model = add_lora(lm.model, LoraSettings(rank=8, alpha=16))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02, generator=torch.Generator(device="cuda").manual_seed(1))
    from workbench.envs import MazeConfig, MazeEnv, system_prompt
    from workbench.rl import user_text

    fmt = chat_format(lm.processor)
    config = MazeConfig(size=9, px_per_cell=25)
    obs, info = MazeEnv(config).reset(seed=0)
    stream = start_stream(lm.processor, fmt, system_prompt(config))
    streams = [append_user(stream, lm.processor, fmt, user_text(obs, info, config),
                           encode_image(lm.processor, obs["image"]))] * 2

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        return _logprobs_and_lora_grads(model, streams, lm.processor)

    assert fp8_unsupported(model) == ""
    bf16 = run()
    use_fp8_base(model)
    eager = run()
    compile_for_training(model)
    compiled = run()
    finite = eager[0].isfinite()  # the image's placeholder tokens are banned: -inf in all
    assert torch.equal(compiled[0].isfinite(), finite) and int(finite.sum()) > 100
    gap = (compiled[0] - eager[0])[finite].abs()
    fp8_error = (eager[0] - bf16[0])[finite].abs()
    print(f"log-probs, compiled vs eager FP8: max {float(gap.max()):.3g}, median "
          f"{float(gap.median()):.3g}; eager FP8 vs bf16: max {float(fp8_error.max()):.3g}, "
          f"median {float(fp8_error.median()):.3g}")
    # the two FP8 paths round apart by no more than FP8 rounds from bf16
    assert float(gap.max()) < 0.1 and float(gap.median()) <= float(fp8_error.median())
    assert float(torch.nn.functional.cosine_similarity(compiled[1], eager[1], dim=0)) > 0.99
    assert float(fp8_error.median()) < 0.02
    assert float(torch.nn.functional.cosine_similarity(eager[1], bf16[1], dim=0)) > 0.98


def test_a_run_with_fp8_and_no_truncated_importance_sampling_says_so_first() -> None:
    """speed.fp8_base or engine.vllm_fp8 with a loss whose ratio is taken to the sampler (ppo,
    importance_sampling) and algorithm.tis_cap=0: the run starts with one line naming the key
    to set; with a cap, with cispo (its weight is clipped already) or without FP8: nothing."""
    from workbench.rl.train import fp8_ratio_line

    fp8 = apply_overrides(PRESETS["tiny"], ["speed.fp8_base=true"])
    assert fp8_ratio_line(fp8).endswith("set algorithm.tis_cap=2 (truncated importance "
                                        "sampling)")
    assert "ppo's ratio" in fp8_ratio_line(fp8)
    for quiet in (["algorithm.tis_cap=2"], ["algorithm.loss=cispo"], ["speed.fp8_base=false"]):
        assert fp8_ratio_line(apply_overrides(fp8, quiet)) == ""
    vllm = apply_overrides(PRESETS["tiny"], ["engine.name=vllm", "engine.vllm_fp8=true"])
    assert fp8_ratio_line(vllm).startswith("engine.vllm_fp8 with algorithm.tis_cap=0")
    both = apply_overrides(vllm, ["speed.fp8_base=true"])
    assert fp8_ratio_line(both).startswith("speed.fp8_base and engine.vllm_fp8 with")
    assert fp8_ratio_line(apply_overrides(both, ["algorithm.tis_cap=2"])) == ""
