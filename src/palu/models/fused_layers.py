"""A transformers model's own elementwise layers as one GPU launch each, while a batch is answered.

Of a 64 x 4K-token prefill of SmolLM2 on the H200 (results/checks/h200-step-profile-fp16.json),
about half the kernel time was elementwise passes around the GEMMs and attention: LlamaRMSNorm
is seven (cast, square, mean, add + rsqrt, multiply, cast, weight), RoPE ten (two `rotate_half`
concatenations, four products, two sums), SiLU * up two. Inside `fused_layers(model)` the model's
RMSNorm and SwiGLU MLP modules, its family's `apply_rotary_pos_emb` and Palu's own rotation
(`palu.attention.rope`, its compressed attention's queries and rebuilt keys) run the Triton kernels of
`palu_kernels.fused_ops` instead: the same expressions with torch's rounding points (RoPE and
SiLU * up bit for bit; RMSNorm's sum of squares is reduced in another order). Every method's
prefill and decode step goes through these layers, so all of them gain alike.

Only families whose modules compute exactly these expressions are touched (`NORMS`, `MLPS`,
`ROPE_MODULES`: Llama, Mistral, Qwen2, Qwen3); Gemma-3 (a `1 + weight` norm, GELU), OLMo-2, Phi-3
and the rest keep their own forwards. Off the GPU, without `palu_kernels`, with PALU_FUSED_OPS=0
or in float32 (`DTYPES`) nothing is touched, and leaving the context restores every module: the
CPU tests' float64 path is the torch one.

The rotary function is a module-level name each family's attention looks up at call time, so it is
swapped in the family's module for the context's duration (one process, one thread: the pipeline's
steps); the norms and MLPs get an instance `forward`.
"""
from __future__ import annotations

import contextlib
import os
import sys

import torch

from ..attention import rope as palu_rope

NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}
MLPS = {"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"}
ROPE_MODULES = {"transformers.models.llama.modeling_llama", "transformers.models.mistral.modeling_mistral",
                "transformers.models.qwen2.modeling_qwen2", "transformers.models.qwen3.modeling_qwen3"}
# half precision only: a float32 run on a GPU stands beside the CPU's float32 results
# (results/checks/h200-vs-cpu.json), and torch's own layers keep it closest to them
DTYPES = (torch.float16, torch.bfloat16)
_MARK = "_palu_fused"


def enabled() -> bool:
    value = os.environ.get("PALU_FUSED_OPS", "1")
    if value not in ("0", "1"):
        raise ValueError(f"PALU_FUSED_OPS={value!r}: expected 1 (fused norms, MLPs and RoPE on a GPU) or 0")
    return value == "1"


def unsupported(model) -> str | None:
    """None if `fused_layers` would fuse something of `model` here, else why not."""
    if not enabled():
        return "PALU_FUSED_OPS=0"
    params = getattr(model, "parameters", None)
    p = next(params(), None) if callable(params) else None
    if p is None:
        return "no parameters (not a torch model)"
    if p.dtype not in DTYPES:
        return f"dtype {p.dtype} (fused in {', '.join(str(d) for d in DTYPES)} only)"
    if p.device.type != "cuda":
        return "not on a GPU"
    try:
        import palu_kernels.fused_ops  # noqa: F401
    except ImportError:
        return "palu_kernels is not importable"
    return None


@contextlib.contextmanager
def fused_layers(model, force: bool = False):
    """Run `model`'s RMSNorms, SwiGLU MLPs and RoPE through the fused kernels inside the context
    (where `unsupported(model)` is None; `force`: whatever the device, for the interpreter tests).
    Yields the number of modules and functions swapped (0: nothing touched)."""
    if not force and unsupported(model) is not None:
        yield 0
        return
    from palu_kernels import fused_ops
    swapped: list = []
    ropes: list = []
    try:
        for m in model.modules():
            if getattr(m, _MARK, False):
                continue
            name = type(m).__name__
            if name in NORMS and isinstance(getattr(m, "weight", None), torch.Tensor):
                m.forward = _norm_forward(m, fused_ops)
            elif name in MLPS and _silu(m):
                m.forward = _mlp_forward(m, fused_ops)
            else:
                continue
            setattr(m, _MARK, True)
            swapped.append(m)
        modules = {type(m).__module__ for m in model.modules()} & ROPE_MODULES
        for mod_name in sorted(modules):
            mod = sys.modules[mod_name]
            original = getattr(mod, "apply_rotary_pos_emb", None)
            if original is None or getattr(original, _MARK, False):
                continue
            mod.apply_rotary_pos_emb = _rope_function(original, fused_ops)
            ropes.append((mod, original))
        # Palu's own attention rotates its queries and rebuilt keys (`palu.attention.rope`)
        if palu_rope.kernel is None and any(getattr(getattr(m, "geom", None), "rope", False)
                                            for m in model.modules()):
            palu_rope.kernel = _palu_rope(fused_ops)
            ropes.append((palu_rope, None))
        yield len(swapped) + len(ropes)
    finally:
        for m in swapped:
            del m.forward
            delattr(m, _MARK)
        for mod, original in ropes:
            if mod is palu_rope:
                palu_rope.kernel = None
            else:
                mod.apply_rotary_pos_emb = original


def _silu(mlp) -> bool:
    act = getattr(mlp, "act_fn", None)
    return (all(hasattr(mlp, k) for k in ("gate_proj", "up_proj", "down_proj"))
            and type(act).__name__ in ("SiLUActivation", "SiLU"))


def _kernel_runs(x: torch.Tensor) -> bool:
    return x.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _norm_forward(norm, ops):
    torch_forward = type(norm).forward.__get__(norm)

    def forward(x):
        if not _kernel_runs(x) or x.dtype != norm.weight.dtype:
            return torch_forward(x)
        return ops.rms_norm_rows(x, norm.weight, norm.variance_epsilon)
    return forward


def _mlp_forward(mlp, ops):
    torch_forward = type(mlp).forward.__get__(mlp)

    def forward(x):
        if not _kernel_runs(x):
            return torch_forward(x)
        return mlp.down_proj(ops.silu_times(mlp.gate_proj(x), mlp.up_proj(x)))
    return forward


def _rope_applies(x, cos, sin) -> bool:
    """Whether `palu_kernels.fused_ops.rope` takes x (B, H, T, D) with cos / sin (B or 1, T, D)."""
    D = x.shape[-1]
    return (_kernel_runs(x) and x.dim() == 4 and cos.dim() == 3 and cos.shape[-1] == D and D & (D - 1) == 0
            and cos.shape[0] in (1, x.shape[0]) and cos.shape[1] == x.shape[2] and sin.shape == cos.shape
            and x.dtype == cos.dtype == sin.dtype)


def _palu_rope(ops):
    def rotate(x, cos, sin):
        return ops.rope(x, cos, sin) if _rope_applies(x, cos, sin) else None
    return rotate


def _rope_function(original, ops):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, **kwargs):
        if unsqueeze_dim != 1 or kwargs or not (_rope_applies(q, cos, sin) and _rope_applies(k, cos, sin)):
            return original(q, k, cos, sin, unsqueeze_dim, **kwargs)
        return ops.rope(q, cos, sin), ops.rope(k, cos, sin)
    setattr(apply_rotary_pos_emb, _MARK, True)
    return apply_rotary_pos_emb
