"""Fisher information of the K and V projections: squared gradients of the LM loss.

Two statistics from one backward pass per window, each per layer, per K/V and per KV head (so any
group size can be reduced from it later):
- `fisher`: of the projection *weights* (the sum of the squared weight gradients in that head's
  rows), what the Fisher rank methods weigh blocks by;
- `rms_fisher`: the official Palu code's scoring of the same gradients: each weight's RMS
  gradient over the windows (sqrt of its mean squared gradient), averaged over the head's weights;
  the square root per weight flattens the extremes before aggregation (`fisher_rms` ranks);
- `output_fisher`: of the projection *outputs* (the mean over tokens and the head's output
  coordinates of the squared gradient of the loss with respect to the K or V output), how much
  the loss responds to an error in that block's output: what `error_aware` allocation weighs
  the exact truncation error of each block by.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.adapters import adapter_for, geometry_of
from ..progress import steps

FISHER_STATS = ("fisher", "rms_fisher", "output_fisher")    # what the fisher step saves


@dataclass
class FisherWindows:
    """The windows squared gradients are accumulated over: other windows (seed) than the Gram's,
    from the same calibration text. The one home of these defaults: `palu.fisher_data` and the
    pipeline's `fisher.*` settings both read them."""
    samples: int = 8
    seqlen: int = 2048
    seed: int = 1
# float16 gradients flush below 6e-8 (a 7B model's K/V weight gradients sit near there): the loss
# is multiplied by a power of two before the backward pass and every statistic divided by it
# after, as mixed-precision training does; a pass that overflows is redone at half the scale.
# bfloat16 and float32 have float32's range and need none.
FP16_LOSS_SCALE = 2.0 ** 16


def loss_scale(model) -> float:
    return FP16_LOSS_SCALE if next(model.parameters()).dtype == torch.float16 else 1.0


def scaled_backward(loss_fn, grads_of, scale: float, on_retry=None) -> float:
    """Backward of `scale * loss_fn()`, halving `scale` until every gradient `grads_of()` lists
    is finite; returns the scale used. `on_retry()` discards what the failed pass accumulated."""
    while True:
        (loss_fn() * scale).backward()
        if scale == 1.0 or all(torch.isfinite(g).all() for g in grads_of()):
            return scale
        if scale < 2.0:
            raise FloatingPointError("non-finite gradients even without loss scaling")
        scale /= 2
        if on_retry is not None:
            on_retry()


def collect_fisher(model, windows: torch.Tensor, progress: bool = True) -> dict:
    """Return {"fisher", "rms_fisher", "output_fisher": (layers, 2, kv_heads) float64, "windows": n}.
    Only K/V weights get grads."""
    adapter, geom = adapter_for(model.config), geometry_of(model.config)
    layers = adapter.layers(model)
    weights = []
    for layer in layers:
        _, k, v, _ = adapter.projections(adapter.attention(layer))
        weights.append((k.weight, v.weight))
    saved = {p: p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    for kw, vw in weights:
        kw.requires_grad_(True)
        vw.requires_grad_(True)
    squares = [[torch.zeros_like(kw, dtype=torch.float64), torch.zeros_like(vw, dtype=torch.float64)]
               for kw, vw in weights]
    outputs = [[torch.zeros(kw.shape[0], dtype=torch.float64, device=kw.device),
                torch.zeros(vw.shape[0], dtype=torch.float64, device=vw.device)] for kw, vw in weights]

    # this window's output statistics (of the scaled loss), added once its pass is finite
    window_outputs = [[torch.zeros_like(a) for a in pair] for pair in outputs]

    def output_hook(acc):
        def backward(g):       # returns None: the gradient itself is left as it is
            acc.add_(g.double().pow(2).reshape(-1, g.shape[-1]).sum(0))

        def forward(_module, _args, out):
            out.register_hook(backward)
        return forward

    hooks = []
    for layer, acc in zip(layers, window_outputs):
        _, k, v, _ = adapter.projections(adapter.attention(layer))
        hooks += [k.register_forward_hook(output_hook(acc[0])), v.register_forward_hook(output_hook(acc[1]))]
    device = next(model.parameters()).device
    tokens, scale = 0, loss_scale(model)

    def restart():
        model.zero_grad(set_to_none=True)
        for pair in window_outputs:
            for a in pair:
                a.zero_()

    try:
        for window in steps(windows, "Fisher", "windows", progress):
            batch = window[None].to(device)
            restart()
            scale = scaled_backward(lambda: model(input_ids=batch, labels=batch, use_cache=False).loss,
                                    lambda: [w.grad for pair in weights for w in pair], scale, restart)
            tokens += batch.numel()
            for acc, pair in zip(squares, weights):
                for j in range(2):
                    acc[j] += (pair[j].grad.double() / scale) ** 2     # on the weights' device
            for acc, window_acc in zip(outputs, window_outputs):
                for j in range(2):
                    acc[j] += window_acc[j] / scale ** 2
    finally:
        for h in hooks:
            h.remove()
        model.zero_grad(set_to_none=True)
        for p, flag in saved.items():
            p.requires_grad_(flag)
    fisher = torch.zeros(len(layers), 2, geom.num_kv_heads, dtype=torch.float64)
    output_fisher, rms_fisher = torch.zeros_like(fisher), torch.zeros_like(fisher)
    n = max(len(windows), 1)
    for i, (acc, out) in enumerate(zip(squares, outputs)):
        for j in range(2):  # rows of head h: h*head_dim .. (h+1)*head_dim
            fisher[i, j] = acc[j].view(geom.num_kv_heads, geom.head_dim, -1).sum(dim=(1, 2)).cpu()
            rms_fisher[i, j] = (acc[j] / n).sqrt().view(geom.num_kv_heads, geom.head_dim, -1).mean(dim=(1, 2)).cpu()
            output_fisher[i, j] = out[j].view(geom.num_kv_heads, geom.head_dim).mean(dim=1).cpu() / max(tokens, 1)
    return {"fisher": fisher, "output_fisher": output_fisher, "rms_fisher": rms_fisher,
            "windows": int(len(windows))}
