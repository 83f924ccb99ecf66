"""Fused RMSNorm and SwiGLU for the trained model's forward and backward, in plain torch.

transformers writes both as chains of elementwise ops, and autograd keeps an intermediate of each
link for the backward: RMSNorm keeps the normalised input beside the input (one extra hidden-sized
tensor a norm), the MLP keeps `silu(gate)` beside `gate` and `up` (one extra intermediate-sized
tensor a layer), and every link allocates its output afresh. The two functions here keep only
what the backward cannot recompute cheaply (the input and the per-token inverse RMS; `gate` and
`up`), work in place where the math allows, and give the same values and gradients to float
rounding. On the 32M Qwen2 the saved activations drop by (2 h + f) / (10 h + 4 f + 2 g d) = 22%
(the planner's activation model follows, `infra.plan.activation_bytes`).

Liger-Kernel does the same on GPUs with Triton kernels (TRL's `use_liger_kernel`); these run on
any device. `fuse_modules` rebinds `forward` on each RMSNorm / gated-SiLU MLP instance of the
Llama-style families (Qwen2/3, Llama, Mistral: SmolLM2 is Llama), so the model's class, its state
dict, LoRA wrapping and FSDP are untouched; inputs that are not float32 take the original forward
(bf16 autocast, a bf16 base).
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
SILU = ("SiLU", "SiLUActivation")  # torch's module, transformers' ACT2FN["silu"]


class RMSNormFn(torch.autograd.Function):
    """y = w * x / sqrt(mean(x^2) + eps) over the last dim; x: (..., H), w: (H,). Saves x and the
    inverse RMS (..., 1)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # ||x||^2 / H without a squared copy of x
        rstd = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(x.shape[-1]).add_(eps).rsqrt_()
        y = x * rstd
        y.mul_(weight)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        h = x.shape[-1]
        xhat = x * rstd
        dweight = None
        if ctx.needs_input_grad[1]:
            dweight = torch.linalg.vecdot(grad.reshape(-1, h), xhat.reshape(-1, h), dim=0)
        gw = grad * weight
        # dx = rstd * (gw - xhat * mean(gw * xhat))
        dot = torch.linalg.vecdot(gw, xhat, dim=-1).unsqueeze(-1).div_(h)
        dx = gw.sub_(xhat.mul_(dot)).mul_(rstd)
        return dx, dweight, None


class SwiGLUFn(torch.autograd.Function):
    """silu(gate) * up, both (..., F). Saves gate and up; silu(gate) is recomputed in backward."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        out = F.silu(gate)
        out.mul_(up)
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        s = torch.sigmoid(gate)
        dup = (gate * s).mul_(grad) if ctx.needs_input_grad[1] else None
        # d silu(g) / dg = s * (1 + g * (1 - s))
        dgate = torch.sub(1, s).mul_(gate).add_(1).mul_(s).mul_(up).mul_(grad) if ctx.needs_input_grad[0] else None
        return dgate, dup


def _fp32(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 for t in tensors) and not torch.is_autocast_enabled(tensors[0].device.type)


def _rms_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    if not _fp32(hidden_states, self.weight):
        return type(self).forward(self, hidden_states)
    return RMSNormFn.apply(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    if not _fp32(gate, up):
        return self.down_proj(self.act_fn(gate) * up)
    return self.down_proj(SwiGLUFn.apply(gate, up))


def fuse_module(module: nn.Module) -> bool:
    """Rebind the fused forward on one Llama-style RMSNorm or gated MLP; False if it is neither."""
    name = type(module).__name__
    if name.endswith("RMSNorm") and hasattr(module, "variance_epsilon") and hasattr(module, "weight"):
        module.forward = types.MethodType(_rms_forward, module)
        return True
    if name.endswith("MLP") and type(getattr(module, "act_fn", None)).__name__ in SILU and hasattr(module, "up_proj"):
        module.forward = types.MethodType(_mlp_forward, module)
        return True
    return False


def fuse_modules(model: nn.Module) -> int:
    """`fuse_module` over `model` when its family is known (`FAMILIES`, SiLU activation);
    returns how many modules now use the fused forwards (0: left as loaded)."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in FAMILIES or getattr(config, "hidden_act", None) != "silu":
        return 0
    return sum(fuse_module(m) for m in model.modules())
