"""A padded batch's kept tokens in a fixed number of slots per (row, KV head), one token dropped a
step once a head holds its cap: decode steps of the methods that evict as they decode
(StreamingLLM: the oldest token past the sinks; TOVA: the token the step's query attends to
least; H2O: the older token with the least attention summed over every step, kept per slot),
with one shape and no host read, so they replay as CUDA graphs
(`eval/static_subset.greedy_static_subset`).

After the method's own eager prefill a head holds at most `policy.slot_cap` tokens (rows holding
fewer led by filler slots); here each layer gets min(cap + 1, held + new) slots. A step writes each
(row, head)'s token into that head's free slot, attends to every slot the head holds (the
softmax written out: its weights are TOVA's votes), then a head holding cap + 1 tokens drops
`policy.slot_victim` (which becomes its free slot) and any other head's free slot is its first
empty one. Same tokens held as the eager cache's `keep`, in another slot order (attention does
not depend on it; the float64 tests compare with each prompt alone). Rows that end can leave the
batch (`select_rows`, when `static_decode.shrinks`; their bytes are counted as they leave)."""
from __future__ import annotations

import torch

from .subset_cache import FILLER


class EvictingSlots:
    def __init__(self, cache, new_tokens: int, policy):
        self.policy, self.cap = policy, policy.slot_cap
        self.keys, self.values, self.positions, self.held, self.free, self.counts = [], [], [], [], [], []
        self.accumulated = []   # per layer (B, H, W) float32: a token's attention summed over steps (H2O)
        for i, lay in enumerate(cache.layers):
            if lay.keys is None:
                raise ValueError(f"layer {i} holds no tokens: prefill the batch through the cache first")
            B, H, n, d = lay.keys.shape
            if n > self.cap:
                raise RuntimeError(f"layer {i} holds {n} slots after the prefill, more than its cap {self.cap}")
            width = max(n + 1, min(self.cap + 1, n + new_tokens))
            held = torch.zeros(B, H, width, dtype=torch.bool, device=lay.keys.device)
            held[..., :n] = lay.positions >= 0
            positions = torch.full((B, H, width), FILLER, dtype=lay.positions.dtype, device=lay.keys.device)
            positions[..., :n] = lay.positions
            for src, out in ((lay.keys, self.keys), (lay.values, self.values)):
                buf = src.new_zeros(B, H, width, d)
                buf[:, :, :n] = src
                out.append(buf)
            # the layer keeps views of its slots, not a second copy of the kept tokens
            lay.keys, lay.values = self.keys[-1][:, :, :n], self.values[-1][:, :, :n]
            self.positions.append(positions)
            self.held.append(held)
            self.free.append(self._first_empty(held))
            self.counts.append(held[:, 0].sum(-1))                                # (B,) tokens kept
            if policy.accumulates:
                self.accumulated.append(self._accumulated(cache, i, held, width))
        self.layers = cache.layers   # their views of the slots follow `select_rows`

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep the batch rows `rows` (a device index, in order): the rows that ended leave."""
        for name in ("keys", "values", "positions", "held", "free", "counts", "accumulated"):
            setattr(self, name, [t[rows] for t in getattr(self, name)])
        for lay, keys, values in zip(self.layers, self.keys, self.values):
            n = lay.keys.shape[2]
            lay.keys, lay.values = keys[:, :, :n], values[:, :, :n]   # views again: the old slots are freed

    @staticmethod
    def _accumulated(cache, layer: int, held: torch.Tensor, width: int) -> torch.Tensor:
        """The prefill's accumulated attention of each held token, in its slot: the policy's
        (B, H, n) for an unpadded batch, each row's own policy's (1, H, n_b) over its real slots
        (in slot order, every KV head holding n_b) for a padded one."""
        B, H, _ = held.shape
        out = torch.zeros(B, H, width, dtype=torch.float32, device=held.device)
        if cache.row_policies is None:
            state = cache.policy.accumulated[layer]
            out[..., :state.shape[-1]] = state
            return out
        for b, policy in enumerate(cache.row_policies):
            out[b].masked_scatter_(held[b], policy.accumulated[layer][0].float())
        return out

    @staticmethod
    def _first_empty(held: torch.Tensor) -> torch.Tensor:
        return (~held).to(torch.int8).argmax(-1)                                  # (B, H)

    def attend(self, layer: int, queries, keys, values, scale: float, positions) -> torch.Tensor:
        """One decode step of the layer: each head's new token (B, H, 1, d) at `positions` (B, 1)
        written to its free slot, the queries (B, nh, 1, d) attending to what the head holds, then
        the head's drop: (B, nh, 1, d)."""
        K, V, pos, held, free = (self.keys[layer], self.values[layer], self.positions[layer],
                                 self.held[layer], self.free[layer])
        B, H, W, d = K.shape
        slot = free[..., None]                                                     # (B, H, 1)
        K.scatter_(2, slot[..., None].expand(B, H, 1, d), keys)
        V.scatter_(2, slot[..., None].expand(B, H, 1, d), values)
        pos.scatter_(2, slot, positions.view(B, 1, 1).expand(B, H, 1).to(pos.dtype))
        held.scatter_(2, slot, True)
        grouped = queries.reshape(B, H, -1, d)                                     # (B, H, rep, d)
        logits = (grouped @ K.transpose(-1, -2)) * scale
        weights = logits.masked_fill(~held[:, :, None], float("-inf")).softmax(-1)
        out = (weights @ V).reshape(B, -1, 1, d)
        over = held.sum(-1) > self.cap                                             # (B, H)
        votes = weights.mean(2)
        if self.accumulated:   # H2O: the new token's sum starts here, every held token adds its share
            votes = self.accumulated[layer]
            votes.scatter_(2, slot, 0.0)
            votes.add_(weights.sum(2).float().masked_fill(~held, 0.0))
        victim = self.policy.slot_victim(votes, pos, held)
        dropped = held.gather(2, victim[..., None]) & ~over[..., None]            # unchanged unless over
        held.scatter_(2, victim[..., None], dropped)
        free.copy_(torch.where(over, victim, self._first_empty(held)))
        return out

    def advance(self) -> None:
        """Nothing: each head's next slot is found on the device."""

    def row_tokens(self, new: dict[int, int]) -> dict[int, list[int]]:
        """Row b's tokens per layer (b in `new`: a place in the batch) once it has decoded `new[b]`
        tokens into the cache: a head that held c tokens holds min(c + new[b], cap) (a step adds
        one and, past the cap, drops one)."""
        kept = torch.stack(self.counts).tolist()                                   # (layers, B)
        return {b: [min(layer[b] + extra, self.cap) for layer in kept] for b, extra in new.items()}
