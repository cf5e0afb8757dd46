"""What Palu attention needs from a cache that holds latents (both latent caches implement it).

The attention module talks to this protocol, never to a cache class, so caches and attention
import nothing of each other:

    stored = cache.store_latents(layer_idx, hk, hv, position_ids, ranks)
    if the kernels can serve the step: stored.kernel_latents(groups), stored.kernel_positions()
    else (the torch path):             stored.latents(dtype), stored.positions, stored.mask(...)
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from palu.quant.packed import UNQUANTISED


class StoredLatents(Protocol):
    """One layer's latents after this step's were stored."""
    bits: int                 # packed width, 16 (UNQUANTISED) for latents in the model's dtype
    cached: bool              # held by a cache (the decode kernels read only cached latents)
    kernel_layout: bool       # stored as the kernels read them (not channel-grouped)

    @property
    def positions(self) -> torch.Tensor:
        """(B or 1, S) positions of the cached tokens (RoPE rebuilds keys at them)."""

    def mask(self, attention_mask, T: int):
        """The torch path's attention mask over the S cached tokens (None: causal / all)."""

    def kernel_mask(self, attention_mask, T: int):
        """The mask the kernel eligibility check reads (never a device value to sync on while a
        CUDA graph is captured)."""

    def latents(self, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, S, R) in `dtype` (dequantised when packed)."""

    def kernel_latents(self, groups: int):
        """Keys and values in the kernels' layout ([B, G, S, r] or packed QuantLatents)."""

    def kernel_positions(self) -> dict:
        """The position keywords of `kernel_decode` (kpos / contiguous, or lengths / offsets)."""


@runtime_checkable
class LatentStore(Protocol):
    def store_latents(self, layer_idx: int, hk: torch.Tensor, hv: torch.Tensor, positions,
                      ranks: tuple[list[int], list[int]]) -> StoredLatents:
        """Append latents (B, T, R) at `positions` ((B or 1, T), None: after what is cached)."""


def palu_layers(model) -> dict:
    """{layer index: Palu attention module} of a model with Palu installed (an error if none
    is). Modules are found by their `stores_latents` mark, so no attention class is imported."""
    found = {m.layer_idx: m for m in model.modules() if getattr(m, "stores_latents", False)}
    if not found:
        raise ValueError("the model has no Palu attention: install it first (palu.compress, "
                         "palu.load_compressed or palu.install_palu)")
    return found


def check_latent_model(model, cache: str) -> dict:
    """`model`'s Palu modules by layer; an error unless every decoder layer has one (a latent
    cache on an uncompressed model would store full K/V and call them latents)."""
    from ..models.adapters import check_rope
    check_rope(model.config, cache)
    modules = palu_layers(model)
    n_layers = model.config.num_hidden_layers
    if sorted(modules) != list(range(n_layers)):
        raise ValueError(f"Palu attention is installed in layers {sorted(modules)}, not in all "
                         f"{n_layers}: {cache} holds latents only")
    return modules


def causal_mask(attention_mask, T: int, S: int, device):
    """The mask of T query tokens over S cached ones (the newest T are the queries)."""
    if attention_mask is not None:
        return attention_mask[..., :S]
    if S == T or T == 1:
        # plain causal without a cache: SDPA's is_causal (its fast kernels); one query token
        # sees every cached token: no mask (a tensor here cost the kernel path a host sync)
        return None
    t = torch.arange(T, device=device)[:, None] + (S - T)
    return torch.arange(S, device=device)[None, :] <= t


class TensorLatents:
    """Latents held as plain (B, S, R) tensors: a step without a latent cache, or one whose
    latents an ordinary transformers Cache stored as a single pseudo-head."""

    bits = UNQUANTISED
    kernel_layout = True

    def __init__(self, hk, hv, positions, cached: bool):
        self.hk, self.hv, self._positions, self.cached = hk, hv, positions, cached

    @property
    def positions(self):
        return self._positions

    def mask(self, attention_mask, T: int):
        return causal_mask(attention_mask, T, self.hk.shape[1], self.hk.device)

    kernel_mask = mask

    def latents(self, dtype):
        return self.hk, self.hv

    def kernel_latents(self, groups: int):
        from palu.quant.packed import as_groups
        return tuple(as_groups(h.unsqueeze(1), groups) for h in (self.hk, self.hv))

    def kernel_positions(self) -> dict:
        return {"kpos": self._positions, "contiguous": None}


def left_pads(attention_mask, B: int, T: int, name: str):
    """(B,) left pads of a batch's first step from its mask (a column no query sees is a pad),
    None when no row is padded. Padding anywhere but at a row's start is refused by name."""
    if attention_mask is None:
        return None
    visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask > -1
    seen_by_some = (visible.any(-2) if visible.dim() == 4 else visible).reshape(B, -1)[:, -T:]
    if bool(seen_by_some.all()):
        return None
    pads = (~seen_by_some).long().cumprod(-1).sum(-1)                          # leading pads
    if bool((pads == T).any()):   # its pads may go on past this step: its offset is unknown here
        raise ValueError(f"{name}: row {int((pads == T).nonzero()[0])} of a padded batch is all padding in "
                         f"its first step ({T} tokens): the first step must hold a token of every row "
                         "(a prefill in chunks: a first chunk past the longest left pad)")
    if not bool((seen_by_some.sum(-1) == T - pads).all()):
        raise ValueError(f"{name} serves left-padded batches: a row's pad tokens must all come "
                         "before its first token (pad on the left; tokenizer.padding_side='left')")
    return pads


def to_device(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A host tensor on `dev` without waiting for the device's queue (a pinned, asynchronous
    copy; a pageable one would synchronise the stream)."""
    if dev.type != "cuda":
        return t.to(dev)
    return t.pin_memory().to(dev, non_blocking=True)


class RowEdits:
    """Beam search and batch edits (`reorder_cache`, `batch_repeat_interleave`,
    `batch_select_indices`) through one `_map_rows(fn)` that applies `fn` to every per-row tensor
    (batch axis first), so a cache's rows move whole."""

    def _map_rows(self, fn) -> None:
        raise NotImplementedError

    def reorder_cache(self, beam_idx) -> None:
        self._map_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices) -> None:
        # the indices come on the model's device; host-side row lists index CPU tensors
        self._map_rows(lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices])
