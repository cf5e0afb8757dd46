"""Fitting KVQuant's state on calibration text (the method itself: palu.methods.kvquant).

`capture_activations` records, per layer, the pre-RoPE keys and values of sampled tokens of the
calibration windows and (for the Fisher weighting) their squared gradients; `fit_from_activations`
computes one setting's codebooks and key ranges from them, so one capture serves every bit width,
weighting and outlier fraction (the pipeline's kvquant_capture and fit_kvquant steps);
`fit_kvquant` does both.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

from ..artifacts import atomic_path
from ..methods.kvquant import KVQuantState, check_settings, outliers_per_vector
from ..models.adapters import adapter_for, check_rope, geometry_of
from ..progress import steps
from ..quant.codebook import lloyd_max
from ..quant.codecs import KVQuantCodec, top_outliers
from .fisher import loss_scale, scaled_backward


def _heads_first(t: torch.Tensor, heads: int, T: int) -> bool:
    """Whether a per-head k-norm's output is (B, H, T, d) (Gemma-3 norms after the transpose)
    rather than (B, T, H, d) (Qwen3 before it)."""
    if t.dim() != 4:
        raise ValueError(f"a per-head k-norm output of shape {tuple(t.shape)}: expected 4 dims")
    if heads == T:
        raise ValueError(f"KVQuant calibration windows of {T} tokens with {heads} KV heads: the k-norm "
                         "output's layout is ambiguous; use windows of another length")
    return t.shape[1] == heads and t.shape[2] == T


def _capture(model, windows, fisher: bool, per_window: int, seed: int, progress: bool):
    """Per layer: pre-RoPE keys and values (N, H, d) of `per_window` random tokens of each
    window (the first token excluded: the sink is kept exact), and their squared gradients."""
    adapter, geom = adapter_for(model.config), geometry_of(model.config)
    check_rope(model.config, "KVQuant (pre-RoPE keys)")
    H, d = geom.num_kv_heads, geom.head_dim
    layers = adapter.layers(model)
    acts = {(i, kind): [] for i in range(len(layers)) for kind in "kv"}
    grads = {key: [] for key in acts}
    live: dict = {}
    handles = []

    layout: dict = {}      # key -> whether the captured tensor is (B, H, T, d), not (B, T, ...)
    window_len = [0]

    def hook(key, norm_kind=None):
        def fn(module, inputs, output):
            out = output.detach().requires_grad_(fisher)
            live[key] = out
            layout[key] = norm_kind == "head" and _heads_first(out, H, window_len[0])
            return out
        return fn

    for i, layer in enumerate(layers):
        attn = adapter.attention(layer)
        _, k, v, _ = adapter.projections(attn)
        # the keys KVQuant quantises are the ones cached: after the family's k-norm, before RoPE
        _, k_norm = adapter.norms(attn)
        k_source = k if k_norm is None else k_norm
        handles += [k_source.register_forward_hook(hook((i, "k"), adapter.qk_norm)),
                    v.register_forward_hook(hook((i, "v")))]
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    scale = loss_scale(model)      # float16 gradients underflow: calib/fisher.py
    try:
        for window in steps(windows, "calibration activations", "windows", progress):
            T = window_len[0] = window.numel()
            pick = 1 + torch.randperm(T - 1, generator=gen)[:per_window]
            batch = window[None].to(device)
            if fisher:
                scale = scaled_backward(
                    lambda: model(input_ids=batch, labels=batch, use_cache=False).loss,
                    lambda: [t.grad for t in live.values()], scale, lambda: model.zero_grad(set_to_none=True))
            else:
                with torch.no_grad():
                    model(input_ids=batch, use_cache=False)
            for key, t in live.items():
                tokens_first = (lambda x: x.transpose(1, 2)) if layout[key] else (lambda x: x)
                acts[key].append(tokens_first(t.detach())[0, pick].reshape(-1, H, d).float().cpu())
                if fisher:
                    g = tokens_first(t.grad)[0, pick].reshape(-1, H, d)
                    grads[key].append(((g.double() / scale) ** 2).float().cpu())
            live.clear()
            model.zero_grad(set_to_none=True)
    finally:
        for h in handles:
            h.remove()
    cat = lambda lst: torch.cat(lst) if lst else None
    return {key: cat(v) for key, v in acts.items()}, ({key: cat(v) for key, v in grads.items()}
                                                      if fisher else None)


@dataclass
class KVQuantActivations:
    """Calibration activations KVQuant fits on: per layer, pre-RoPE keys and values (N, H, d)
    of sampled tokens and (with `fisher`) their squared gradients. One capture serves every bit
    width, weighting and outlier fraction (the pipeline's kvquant_capture step)."""
    acts: dict      # {(layer, "k" | "v"): (N, H, d)}
    grads: Optional[dict]
    info: dict

    def save(self, path: str | Path) -> None:
        tensors = {f"{kind}{i}": t for (i, kind), t in self.acts.items()}
        if self.grads is not None:
            tensors.update({f"g{kind}{i}": t for (i, kind), t in self.grads.items()})
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata={"info": json.dumps(self.info, sort_keys=True)})

    @classmethod
    def load(cls, path: str | Path) -> "KVQuantActivations":
        from safetensors import safe_open
        with safe_open(str(path), "pt") as f:
            info = json.loads(f.metadata()["info"])
        t = load_file(str(path))
        layers = info["layers"]
        acts = {(i, kind): t[f"{kind}{i}"] for i in range(layers) for kind in "kv"}
        grads = ({(i, kind): t[f"g{kind}{i}"] for i in range(layers) for kind in "kv"}
                 if "gk0" in t else None)
        return cls(acts, grads, info)


def capture_activations(model, windows: torch.Tensor, fisher: bool = True, tokens_per_window: int = 256,
                        seed: int = 0, progress: bool = True, info: Optional[dict] = None) -> KVQuantActivations:
    """Keys, values (and squared gradients) of `tokens_per_window` random tokens per window."""
    from .stats_file import model_identity
    acts, grads = _capture(model, windows, fisher, tokens_per_window, seed, progress)
    layers = geometry_of(model.config).num_layers
    # the model they came from: a state fitted on them is refused on any other (KVQuant.install)
    return KVQuantActivations(acts, grads, {**(info or {}), "model": model_identity(model), "layers": layers,
                                            "tokens": int(acts[(0, "k")].shape[0]),
                                            "windows": int(len(windows)), "tokens_per_window": tokens_per_window,
                                            "seed": seed, "fisher": fisher})


def fit_kvquant(model, windows: torch.Tensor, bits: int = 3, weighting: str = "fisher",
                outlier_fraction: float = 0.01, tokens_per_window: int = 256, seed: int = 0,
                progress: bool = True, info: Optional[dict] = None) -> KVQuantState:
    """Fit KVQuant's per-layer codebooks (and the keys' per-channel ranges) on calibration
    `windows` (n, T) of an *unmodified* model."""
    check_settings(bits, weighting, outlier_fraction)
    captured = capture_activations(model, windows, weighting == "fisher", tokens_per_window, seed,
                                   progress, info)
    return fit_from_activations(captured, bits, weighting, outlier_fraction,
                                device=next(model.parameters()).device)


def fit_from_activations(captured: KVQuantActivations, bits: int, weighting: str,
                         outlier_fraction: float, device: str | torch.device = "cpu") -> KVQuantState:
    """The codebooks and key ranges of one setting, computed on `device` (a GPU fits a 7B
    model's 32 layers in seconds) and returned on the CPU."""
    check_settings(bits, weighting, outlier_fraction)
    if weighting == "fisher" and captured.grads is None:
        raise ValueError("weighting=fisher needs activations captured with their gradients (fisher=True)")
    acts, grads = captured.acts, captured.grads
    n_layers = captured.info["layers"]
    d = acts[(0, "k")].shape[-1]
    k_out = outliers_per_vector(outlier_fraction, d)
    key_cb, value_cb, offsets, scales = [], [], [], []
    q = outlier_fraction / 2
    for i in range(n_layers):
        keys, values = acts[(i, "k")].to(device), acts[(i, "v")].to(device)
        lo = torch.quantile(keys, q, dim=0) if q > 0 else keys.amin(0)
        hi = torch.quantile(keys, 1 - q, dim=0) if q > 0 else keys.amax(0)
        off, sc = (hi + lo) / 2, ((hi - lo) / 2).clamp_min(1e-6)
        offsets.append(off.half().float().cpu())
        scales.append(sc.half().float().cpu())
        # the normalised entries each codebook will code (outliers taken out as at encode time)
        probe = KVQuantCodec(bits, None, k_out, per_channel=True, head_dim=d,
                             channel_offset=[offsets[-1]], channel_scale=[scales[-1]])
        zk, _ = probe.normalise(keys[None].transpose(1, 2), 0)        # this layer's ranges
        zv, _ = KVQuantCodec(bits, None, k_out, per_channel=False, head_dim=d).normalise(
            values[None].transpose(1, 2), 0)
        for z, kind, out in ((zk, "k", key_cb), (zv, "v", value_cb)):
            idx, _ = top_outliers(z, k_out)
            kept = torch.ones_like(z, dtype=torch.bool) if idx is None else \
                torch.ones_like(z, dtype=torch.bool).scatter(-1, idx, False)
            w = (grads[(i, kind)].to(device)[None].transpose(1, 2)[kept] if weighting == "fisher"
                 else torch.ones(int(kept.sum()), device=z.device))
            # stored and counted as fp16
            out.append(lloyd_max(z[kept], w + (1e-30 if weighting == "fisher" else 0), 2 ** bits).half().float().cpu())
    info = {k: v for k, v in captured.info.items() if k not in ("layers", "fisher")}
    return KVQuantState(bits, weighting, float(outlier_fraction), torch.stack(key_cb), torch.stack(value_cb),
                        torch.stack(offsets), torch.stack(scales),
                        {**info, "outliers_per_vector": k_out})
