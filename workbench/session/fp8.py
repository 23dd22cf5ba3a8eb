"""FP8 for the frozen base in the update (`speed.fp8_base`; SkyRL-style alias `trainer.fp8_base`).

With a LoRA adapter the base model's weights never change, so the update may run their GEMMs in
FP8 (e4m3, H100/H200 tensor cores: about 1.7x bf16's rate at the 8B shape's sizes) while the
adapter, its gradients and Adam stay as they were. Per frozen linear layer of the text decoder
(q, k, v, o, gate, up, down; under peft its `base_layer`):

- the weight is quantised once, row-wise (one float32 scale per output channel), into an FP8
  copy kept beside the bf16 weight (the bf16 weight still serves calls without grad, the
  export and vLLM's merged weights);
- forward: the input is quantised row-wise (one scale per token) and multiplied with
  `torch._scaled_mm` (both scales applied in its epilogue, bf16 out);
- backward, the activation gradient only (the weight is frozen): the output gradient is
  multiplied by the weight's per-channel scales, quantised row-wise, and multiplied with the
  transposed FP8 weight (transposed when needed: no second copy is kept);
- each quantisation (absolute max, scale, cast) is one compiled kernel (`torch.compile`), so
  the GEMMs' gain is not spent around them; with `speed.compile_layers` the whole layer,
  quantisation included, is compiled together.

Calls without grad (the sampler's prefill on our engine, `compute_logprobs`) keep the bf16
path. The PPO ratio is taken against the sampler's own log-probs, so the trainer's FP8 error
enters the ratio (its KL to the sampler and its clip fraction are logged every step) and
PPO's clip bounds it.

    layers = use_fp8_base(model)       # -> number of linear layers switched, idempotent
    fp8_unsupported(model)             # why this model/device cannot, or "" (e.g. a CPU)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
MIN_CAPABILITY = (8, 9)  # Ada / Hopper and later: FP8 tensor cores, torch._scaled_mm row-wise
MULTIPLE = 16  # torch._scaled_mm wants every dimension a multiple of 16


def quantize_rows(x_MK: torch.Tensor, col_scale_1K: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x (times col_scale, broadcast over rows, when given) as e4m3 with one float32 scale a
    row: (x_q, scale_M1) with x * col_scale ~= x_q * scale."""
    x = x_MK.float() if col_scale_1K is None else x_MK.float() * col_scale_1K
    scale_M1 = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
    return (x / scale_M1).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale_M1


@functools.cache
def _compiled_quantize_rows() -> Any:
    return torch.compile(quantize_rows, dynamic=True)


def fused_quantize_rows(x: torch.Tensor) -> Any:
    """`quantize_rows` as one kernel a call on CUDA (compiled once for every shape); the plain
    ops on a CPU, and inside a compiled layer, where inductor fuses them with the rest."""
    if x.device.type != "cuda" or torch.compiler.is_compiling():
        return quantize_rows
    return _compiled_quantize_rows()


@dataclass
class Fp8Weight:
    """A frozen weight (N x K) as e4m3 with one float32 scale per output row."""

    w_NK: torch.Tensor
    scale_1N: torch.Tensor


def quantize_weight(weight_NK: torch.Tensor) -> Fp8Weight:
    w_NK, scale_N1 = quantize_rows(weight_NK.detach())
    return Fp8Weight(w_NK=w_NK, scale_1N=scale_N1.reshape(1, -1).contiguous())


class Fp8Matmul(torch.autograd.Function):
    """y = x W^T through FP8 GEMMs; the gradient of x only (W is frozen)."""

    @staticmethod
    def forward(ctx: Any, x_MK: torch.Tensor, w_NK: torch.Tensor,
                scale_1N: torch.Tensor) -> torch.Tensor:
        x_q, x_scale_M1 = fused_quantize_rows(x_MK)(x_MK)
        ctx.save_for_backward(w_NK, scale_1N)
        return torch._scaled_mm(x_q, w_NK.t(), scale_a=x_scale_M1, scale_b=scale_1N,
                                out_dtype=x_MK.dtype)

    @staticmethod
    def backward(ctx: Any, grad_MN: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        w_NK, scale_1N = ctx.saved_tensors
        # dx = g W = (g * s_N) W_q: the weight's row scales move onto the gradient's columns
        g_q, g_scale_M1 = fused_quantize_rows(grad_MN)(grad_MN.contiguous(), scale_1N)
        ones_1K = torch.ones(1, w_NK.shape[1], device=w_NK.device, dtype=torch.float32)
        w_KN = w_NK.t().contiguous()  # _scaled_mm's second operand is column-major
        return (torch._scaled_mm(g_q, w_KN.t(), scale_a=g_scale_M1, scale_b=ones_1K,
                                 out_dtype=grad_MN.dtype), None, None)


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear through `Fp8Matmul` for inputs of any leading shape (rows padded to 16)."""
    lead, k = x.shape[:-1], x.shape[-1]
    x_MK = x.reshape(-1, k)
    rows = x_MK.shape[0]
    pad = -rows % MULTIPLE
    if pad:
        x_MK = F.pad(x_MK, (0, 0, 0, pad))
    y_MN = Fp8Matmul.apply(x_MK, weight.w_NK, weight.scale_1N)[:rows]
    if bias is not None:
        y_MN = y_MN + bias
    return y_MN.reshape(*lead, -1)


def _forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled():
        return fp8_linear(x, vars(module)["fp8_weight"], module.bias)
    return F.linear(x, module.weight, module.bias)


def frozen_linears(model: Any) -> list[torch.nn.Linear]:
    """The text decoder's frozen linear layers whose sizes FP8 GEMMs take (multiples of 16):
    under peft each adapted projection's base_layer; LoRA's own A and B are trainable."""
    from workbench.policy.forward import base_model

    out = []
    for layer in base_model(model).model.language_model.layers:
        for module in layer.modules():
            if isinstance(module, torch.nn.Linear) and not module.weight.requires_grad \
                    and module.in_features % MULTIPLE == 0 \
                    and module.out_features % MULTIPLE == 0:
                out.append(module)
    return out


def fp8_unsupported(model: Any) -> str:
    """Why the update cannot run this model's frozen base in FP8 here ("" when it can)."""
    weight = next(model.parameters())
    if weight.device.type != "cuda":
        return f"FP8 GEMMs need a CUDA GPU (the model is on {weight.device.type})"
    capability = torch.cuda.get_device_capability(weight.device)
    if capability < MIN_CAPABILITY:
        return (f"FP8 GEMMs need compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+ "
                f"(this GPU has {capability[0]}.{capability[1]})")
    if weight.dtype != torch.bfloat16:
        return f"the FP8 path returns bf16: model.dtype must be bfloat16 (it is {weight.dtype})"
    if not frozen_linears(model):
        return "no frozen linear layer in the text decoder (the base is trained: no LoRA)"
    return ""


def drop_fp8_base(model: Any) -> None:
    """Free the FP8 copies (`host.close`); the layers' forward is bf16 again."""
    for module in frozen_linears(model):
        if vars(module).pop("fp8_weight", None) is not None:
            del vars(module)["forward"]


def use_fp8_base(model: Any) -> int:
    """Switch every frozen text-decoder linear's forward with grad to FP8 (`fp8_linear`);
    returns how many. Idempotent. The caller checks `fp8_unsupported` first."""
    switched = 0
    for module in frozen_linears(model):
        if "fp8_weight" not in vars(module):  # kept in the instance's own dict, beside forward
            vars(module)["fp8_weight"] = quantize_weight(module.weight)
            vars(module)["forward"] = functools.partial(_forward, module)
        switched += 1
    return switched
