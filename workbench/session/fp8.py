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
- the GEMM is a custom op (`workbench::fp8_matmul`, its backward registered with it), so
  torch.compile keeps it one node and traces the quantisations around it: with
  `speed.compile_layers` inductor fuses each quantisation (absolute max, scale, cast) into the
  layer's other elementwise work, and one compilation serves every layer; outside a compiled
  layer each quantisation is one compiled kernel of its own, so the GEMMs' gain is not spent
  around them.

Calls without grad (the sampler's prefill on our engine, `compute_logprobs`) keep the bf16
path. Against the sampler's own log-probs the trainer's FP8 error is large (its KL to the
sampler and its clip fraction are logged every step): PPO's ratio would clip most reply tokens,
so FP8 runs take the ratio against the trainer's own log-probs with truncated importance
sampling (`algorithm.tis_cap`, `session.losses.truncated_is`).

    layers = use_fp8_base(model)       # -> number of linear layers switched, idempotent
    fp8_unsupported(model)             # why this model/device cannot, or "" (e.g. a CPU)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

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
    ops on a CPU, and inside a compiled layer, where inductor fuses them with the rest: while
    dynamo traces the forward, or AOTAutograd the backward of `fp8_matmul` (fake tensors)."""
    if x.device.type != "cuda" or torch.compiler.is_compiling() or is_fake(x):
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


@torch.library.custom_op("workbench::fp8_matmul", mutates_args=())
def fp8_matmul(x_MK: torch.Tensor, x_q_MK: torch.Tensor, x_scale_M1: torch.Tensor,
               w_NK: torch.Tensor, scale_1N: torch.Tensor) -> torch.Tensor:
    """y = x W^T from x's FP8 copy (x_q, its row scales) and the weight's: one `_scaled_mm`,
    both scales applied in its epilogue, x's dtype out. x itself is an input for its gradient
    only (`_fp8_matmul_backward`). A custom op, so torch.compile keeps it one node and traces
    the quantisation around it with the rest of the layer."""
    return torch._scaled_mm(x_q_MK, w_NK.t(), scale_a=x_scale_M1, scale_b=scale_1N,
                            out_dtype=x_MK.dtype)


@fp8_matmul.register_fake
def _fp8_matmul_shape(x_MK: torch.Tensor, x_q_MK: torch.Tensor, x_scale_M1: torch.Tensor,
                      w_NK: torch.Tensor, scale_1N: torch.Tensor) -> torch.Tensor:
    return x_MK.new_empty(x_MK.shape[0], w_NK.shape[0])


def _fp8_matmul_save(ctx: Any, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[3], inputs[4])  # the FP8 weight and its row scales


def _fp8_matmul_backward(ctx: Any, grad_MN: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """The gradient of x only (W is frozen): dx = g W = (g * s_N) W_q, the weight's row scales
    moved onto the gradient's columns before it is quantised row-wise."""
    w_NK, scale_1N = ctx.saved_tensors
    g_q, g_scale_M1 = fused_quantize_rows(grad_MN)(grad_MN.contiguous(), scale_1N)
    ones_1K = torch.ones(1, w_NK.shape[1], device=w_NK.device, dtype=torch.float32)
    w_KN = w_NK.t().contiguous()  # _scaled_mm's second operand is column-major
    dx_MK = torch._scaled_mm(g_q, w_KN.t(), scale_a=g_scale_M1, scale_b=ones_1K,
                             out_dtype=grad_MN.dtype)
    return dx_MK, None, None, None, None


fp8_matmul.register_autograd(_fp8_matmul_backward, setup_context=_fp8_matmul_save)


def fp8_mm(x_MK: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """x W^T through FP8 GEMMs, differentiable in x: x quantised row-wise, then `fp8_matmul`."""
    x_q_MK, x_scale_M1 = fused_quantize_rows(x_MK)(x_MK)
    return fp8_matmul(x_MK, x_q_MK, x_scale_M1, weight.w_NK, weight.scale_1N)


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear through `fp8_mm` for inputs of any leading shape (rows padded to 16)."""
    lead, k = x.shape[:-1], x.shape[-1]
    x_MK = x.reshape(-1, k)
    rows = x_MK.shape[0]
    pad = -rows % MULTIPLE
    if pad:
        x_MK = F.pad(x_MK, (0, 0, 0, pad))
    y_MN = fp8_mm(x_MK, weight)[:rows]
    if bias is not None:
        y_MN = y_MN + bias
    return y_MN.reshape(*lead, -1)


class Fp8Linear(torch.nn.Linear):
    """A frozen nn.Linear whose forward with grad runs through FP8 GEMMs (`fp8_linear`); without
    grad it is nn.Linear's. Its FP8 copy is two non-persistent buffers (`fp8_w_NK`,
    `fp8_scale_1N`): state dicts, checkpoints and exports see the bf16 weight only, and
    torch.compile takes the buffers as inputs of one graph shared by every layer (a per-module
    forward or attribute object would be guarded by identity: one compilation a layer)."""

    fp8_w_NK: torch.Tensor
    fp8_scale_1N: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return fp8_linear(x, Fp8Weight(self.fp8_w_NK, self.fp8_scale_1N), self.bias)
        return F.linear(x, self.weight, self.bias)


def frozen_linears(model: Any) -> list[torch.nn.Linear]:
    """The text decoder's frozen linear layers whose sizes FP8 GEMMs take (multiples of 16):
    under peft each adapted projection's base_layer; LoRA's own A and B are trainable."""
    from workbench.policy.forward import base_model

    out = []
    for layer in base_model(model).model.language_model.layers:
        for module in layer.modules():
            if type(module) in (torch.nn.Linear, Fp8Linear) \
                    and not module.weight.requires_grad and module.in_features % MULTIPLE == 0 \
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
    """Free the FP8 copies (`host.close`); the layers are plain nn.Linear again."""
    for module in frozen_linears(model):
        if isinstance(module, Fp8Linear):
            del module.fp8_w_NK, module.fp8_scale_1N
            module.__class__ = torch.nn.Linear  # type: ignore[assignment]


def use_fp8_base(model: Any) -> int:
    """Switch every frozen text-decoder linear to `Fp8Linear` (its FP8 copy made once);
    returns how many. Idempotent. The caller checks `fp8_unsupported` first."""
    switched = 0
    for module in frozen_linears(model):
        if not isinstance(module, Fp8Linear):
            weight = quantize_weight(module.weight)
            module.register_buffer("fp8_w_NK", weight.w_NK, persistent=False)
            module.register_buffer("fp8_scale_1N", weight.scale_1N, persistent=False)
            module.__class__ = Fp8Linear
        switched += 1
    return switched
