"""LoRA recovery (the paper's appendix): a trainable low-rank term refines each latent projection,
h = A x + A' B' x, trained briefly on calibration text with everything else frozen.

Each layer's down projections A_k, A_v (all groups stacked, (R, hidden)) get a delta A' B'
(A': (R, rank), zero at the start, so training starts exactly at the compressed model; B':
(rank, hidden), small random). The loss is distillation: the KL divergence from the original
model's next-token distribution to the compressed one's on the same windows (the compressed model
should behave like the original, and a small calibration set over-fits the LM loss quicker).
Afterwards the delta is merged, A <- A + A' B', so the result is an ordinary Palu checkpoint of
the same ranks and bytes: the cache stores h = A x as before, and nothing at inference changes.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize

from ..attention.palu_attention import PaluAttention
from ..decompose.factors import LayerFactors
from ..progress import steps as progress_steps


@dataclass
class LoraRecovery:
    rank: int = 8            # inner rank of each delta A' B'
    steps: int = 24          # optimiser steps, one calibration window each (cycled)
    lr: float = 1e-3         # AdamW
    init_scale: float = 0.01  # std of B' at the start (A' starts at zero)
    seed: int = 0

    def check(self) -> None:
        for name in ("rank", "steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"recovery.{name}={value!r} must be a positive integer")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"recovery.lr={self.lr!r} must be positive")
        if not self.init_scale > 0:
            raise ValueError(f"recovery.init_scale={self.init_scale!r} must be positive")


class _Delta(nn.Module):
    def __init__(self, rows: int, hidden: int, rank: int, scale: float, gen: torch.Generator, like):
        super().__init__()
        self.down = nn.Parameter(torch.zeros(rows, rank, dtype=like.dtype, device=like.device))
        up = torch.randn(rank, hidden, generator=gen, dtype=torch.float64) * scale
        self.up = nn.Parameter(up.to(dtype=like.dtype, device=like.device))

    def forward(self, A):
        return A + self.down @ self.up


def _palu_layers(model) -> list[PaluAttention]:
    layers = [m for m in model.modules() if isinstance(m, PaluAttention)]
    if not layers:
        raise ValueError("recover() needs a model with Palu attention installed (palu.compress or "
                         "palu.load_compressed)")
    return layers


def recover(model, teacher, windows: torch.Tensor, config: LoraRecovery | None = None,
            progress: bool = True) -> dict:
    """Train the deltas of every Palu layer of `model` against `teacher` (the uncompressed model)
    on `windows` (n, T) for `config.steps` steps, merge them into A_k / A_v (in place) and return
    a report: the KL per step, at the start and end, and the time taken."""
    config = config or LoraRecovery()
    config.check()
    layers = _palu_layers(model)
    gen = torch.Generator().manual_seed(config.seed)
    saved = {p: p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    deltas = []
    try:
        for layer in layers:
            for name in ("A_k", "A_v"):
                A = getattr(layer, name)
                delta = _Delta(A.shape[0], A.shape[1], config.rank, config.init_scale, gen, A)
                parametrize.register_parametrization(layer, name, delta)
                deltas.append(delta)
        params = [p for d in deltas for p in d.parameters()]
        optimiser = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
        device = next(model.parameters()).device
        losses, start = [], time.perf_counter()
        was_training = model.training
        model.train(False)      # no dropout: the deltas are fitted to the inference model
        for step in progress_steps(range(config.steps), "LoRA recovery", "steps", progress):
            batch = windows[step % len(windows)][None].to(device)
            with torch.no_grad():
                target = F.log_softmax(teacher(input_ids=batch, use_cache=False).logits.float(), -1)
            logits = model(input_ids=batch, use_cache=False).logits.float()
            loss = F.kl_div(F.log_softmax(logits, -1), target, log_target=True, reduction="batchmean") \
                / batch.shape[1]
            if not math.isfinite(loss.item()):
                raise FloatingPointError(f"LoRA recovery: non-finite loss at step {step}")
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            optimiser.step()
            losses.append(loss.item())
        model.train(was_training)
    finally:
        for layer in layers:    # merge: A <- A + A' B' (a plain buffer again)
            for name in ("A_k", "A_v"):
                if parametrize.is_parametrized(layer, name):
                    with torch.no_grad():
                        parametrize.remove_parametrizations(layer, name, leave_parametrized=True)
        for p, flag in saved.items():
            p.requires_grad_(flag)
    return {**asdict(config), "windows": int(len(windows)), "seqlen": int(windows.shape[1]),
            "kl": losses, "kl_first": losses[0], "kl_last": losses[-1],
            "seconds": time.perf_counter() - start}


def factors_of(model) -> list[LayerFactors]:
    """The factors of every installed Palu layer (A split back per group), e.g. to save after
    recovery; B is unchanged by it."""
    out = []
    for layer in _palu_layers(model):
        lf = LayerFactors()
        for kind, ranks in (("k", layer.ranks_k), ("v", layer.ranks_v)):
            A = getattr(layer, f"A_{kind}").detach()
            start = 0
            for g, r in enumerate(ranks):
                getattr(lf, f"A_{kind}").append(A[start:start + r].clone())
                getattr(lf, f"B_{kind}").append(getattr(layer, f"B_{kind}{g}").detach().clone())
                start += r
        out.append(lf)
    return out
