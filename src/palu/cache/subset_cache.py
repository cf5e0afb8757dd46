"""A KV cache that keeps a subset of the tokens it has seen (token eviction: `palu/methods/`
streaming_llm.py, snapkv.py), through transformers' Cache API.

Each layer holds keys (after RoPE) and values of the kept tokens only, (B, H, n, d), with their
absolute positions per KV head (int32, counted as metadata: a method that keeps different tokens
per head needs them for its masks). `get_seq_length` is the number of tokens *seen*, so
`generate` gives the next token its true position although fewer are stored.

Which tokens stay is the method's `policy` (`SubsetPolicy`): `visible(q_pos, k_pos)` says which
cached or new tokens a query may attend to during a step (StreamingLLM: the sink and the recent
window; a causal mask otherwise), `keep(...)` which of them the cache holds after the step
(StreamingLLM: the same rule for the next query; SnapKV: after the prefill, the tokens the
prompt's last queries attend to most), and `select(...)` which kept tokens a decode step reads
(Quest: the pages whose keys can score highest). Eviction: bytes read per step = bytes stored;
selection reads fewer than it stores.
"""
from __future__ import annotations

import copy

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .protocol import RowEdits


class SubsetPolicy:
    """What a token-subset method decides. Subclasses override `keep` (and `visible`)."""
    # Whether `keep` may evict after the prefill (StreamingLLM, TOVA, H2O: every step); SnapKV's
    # choice is made once, so a padded batch's decode steps skip its per-row calls.
    keeps_after_prefill = True

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """(B, H, T, S) bool: query at q_pos (B, 1, T) may see key at k_pos (B, H, S). Causal by
        default."""
        return k_pos[..., None, :] <= q_pos[..., None]

    def keep(self, layer: int, queries: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
             seen: int, prefill: bool, scale: float | None = None) -> torch.Tensor | None:
        """Indices (B, H, k) of the tokens to keep out of `keys` (B, H, S, d) after a step whose
        (RoPE'd, normalised) queries were `queries` (B, nh, T, d) and whose softmax scale was
        `scale`; None keeps all."""
        return None

    def select(self, queries: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """For a decode step: (B, H, S) bool of the cached tokens this step reads (query-aware
        selection, Quest); None reads every kept token."""
        return None

    def select_padded(self, queries: torch.Tensor, keys: torch.Tensor, pads: torch.Tensor) -> torch.Tensor | None:
        """`select` for every row of a left-padded batch at once, while row b's tokens are the
        slots [pads[b], S) (nothing evicted): (B, H, S) bool, each row reading what `select` would
        choose for the row alone (pads never). None: every row reads all its tokens.
        `NotImplemented`: no such rule, the batch selects row by row (`select`, one call a row)."""
        return NotImplemented

    def keep_padded(self, layer: int, queries: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                    seen: torch.Tensor, scale: float | None = None) -> torch.Tensor | None:
        """`keep` for every row of a padded batch at once: (B, H, S) bool of the tokens to hold,
        each row deciding over its own tokens (position FILLER: not a token of the row) as `keep`
        would for the row alone; `seen` (B,) each row's tokens seen. None: no such rule, the
        batch decides row by row (`keep`, one call per row)."""
        return None

    def padded_width(self, slots: int, seen: list[int]) -> int | None:
        """The most tokens any row holds after `keep_padded` over `slots` slots (`seen`: each row's
        tokens seen, on the host), so the cache finds the kept width without waiting for the
        device (`slots_of`). A row holds at most `slots` real tokens and one row holds exactly
        that many (the batch is as wide as its fullest row). None: not known on the host."""
        return None

    # decode steps in slots that drop one token a step (`cache/evicting_slots.py`): the most tokens a
    # row's KV head holds after a step; None: no such rule (no eviction after the prefill)
    slot_cap: int | None = None

    def slot_victim(self, votes: torch.Tensor, positions: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
        """(B, H): the slot each row's KV head drops after a step that leaves it `slot_cap` + 1
        tokens, from this step's attention averaged over the head's query heads `votes` (B, H, W),
        the slots' `positions` and which slots hold a token `held` (B, H, W bool); the choice `keep`
        makes for the row alone."""
        raise NotImplementedError

    # whether the slots accumulate every step's attention per token and hand the sums to
    # `slot_victim` as its votes (H2O), instead of the step's attention alone (TOVA)
    accumulates = False

    def map_rows(self, layer: int, fn) -> None:
        """Apply `fn` (a reordering, repetition or selection of the batch axis, dim 0) to any state
        the policy holds per row of `layer` (H2O's accumulated scores); default: none held."""

    def state_for_bytes(self, held: dict) -> "SubsetPolicy":
        """This policy as a row holding `held` {layer: (1, H, n) meta tensor} would hold it, for
        counting bytes (`static_subset.row_nbytes`); default: no state per token, itself."""
        return self


class _SubsetLayer(CacheLayerMixin):
    is_sliding = False
    is_croppable = False

    def __init__(self):
        super().__init__()
        self.keys = self.values = self.positions = None
        self.seen = 0        # token slots seen, a row's left pads included (the next slot's index)
        self.pads = None     # (B,) left pads per row of a padded batch; None: no row padded
        # the same on the host, and whether every slot since then holds a token of its row (no
        # eviction yet, so row b's tokens are slots [pads[b], seen)): a decode step then finds
        # each row's tokens without waiting for the device (subset_attention._by_row)
        self.host_pads: list[int] | None = None
        self.whole = True

    def lazy_initialization(self, key_states, value_states=None):
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # transformers builds a mask over every token seen; the subset attention builds its own
        return self.seen + query_length, 0

    def update(self, *args, **kwargs):
        raise TypeError("a token-subset cache is read through its method's attention "
                        "(method.install(model)), not by a model's own attention")

    def crop(self, max_length: int) -> None:
        raise TypeError("a token-subset cache cannot crop (assisted or prompt-lookup decoding): "
                        "decode without an assistant")

    def map_rows(self, fn) -> None:
        """Beam search and batch edits move a row's keys, values and positions together (the
        positions differ per row once a policy has evicted by attention)."""
        if self.keys is not None:
            self.keys, self.values, self.positions = fn(self.keys), fn(self.values), fn(self.positions)
        if self.pads is not None:
            self.pads = fn(self.pads)
        if self.host_pads is not None:
            self.host_pads = [self.host_pads[i] for i in fn(torch.arange(len(self.host_pads))).tolist()]


class SubsetKVCache(RowEdits, Cache):
    """The kept keys / values / positions per layer, and how many tokens each layer has seen."""

    def __init__(self, policy: SubsetPolicy, num_layers: int, owner: str):
        super().__init__(layers=[_SubsetLayer() for _ in range(num_layers)])
        self.policy, self.owner = policy, owner
        # a padded batch: one policy per row, deciding over that row's own tokens only (its state,
        # H2O's scores, is the row's alone); None while no row is padded (one batched policy)
        self.row_policies: list[SubsetPolicy] | None = None
        # after a prefill, the kept tokens in preallocated slots (`subset_slots.SubsetSlots`,
        # the graph-replayed decode steps of `eval/static_decode.greedy_static_subset`)
        self.slots = None

    def policy_of_row(self, row: int, rows: int) -> SubsetPolicy:
        if self.row_policies is None:
            self.row_policies = [copy.deepcopy(self.policy) for _ in range(rows)]
        return self.row_policies[row]

    def _map_rows(self, fn) -> None:
        """Beam search and batch edits: every layer's rows and the policy's per-row state."""
        for i, lay in enumerate(self.layers):
            lay.map_rows(fn)
            self.policy.map_rows(i, fn)
        if self.row_policies is not None:   # the list follows the rows (copies where repeated)
            order = fn(torch.arange(len(self.row_policies))).tolist()
            self.row_policies = [copy.deepcopy(self.row_policies[i]) for i in order]

    def row(self, b: int) -> "SubsetKVCache":
        """Row `b` alone: a one-row cache of its real tokens (no pads, no filler slots) and its own
        policy state, what the row's prompt alone would hold; `method.cache_nbytes(cache.row(b))`
        counts that row's bytes."""
        shared = self.row_policies is None
        policy = copy.deepcopy(self.policy) if shared else self.row_policies[b]
        out = SubsetKVCache(policy, len(self.layers), self.owner)
        for i, lay in enumerate(self.layers):
            if lay.keys is None:
                if shared:
                    policy.map_rows(i, lambda t: t[b:b + 1])
                continue
            k, v, pos = lay.keys[b:b + 1], lay.values[b:b + 1], lay.positions[b:b + 1]
            pads, idx = 0, None
            if lay.pads is not None:
                pads, idx = int(lay.pads[b]), real_slots(pos)
                k, v, pos = gather_slots(k, idx), gather_slots(v, idx), pos.gather(2, idx)
            if shared:   # a batched policy's state per slot (H2O's sums, `keep_padded`): the row's real slots
                policy.map_rows(i, lambda t: t[b:b + 1] if idx is None else t[b:b + 1].gather(2, idx))
            out.store(i, k, v, pos, lay.seen - pads)
        return out

    def held(self, layer: int):
        lay = self.layers[layer]
        return lay.keys, lay.values, lay.positions, lay.seen

    def store(self, layer: int, keys, values, positions, seen: int) -> None:
        lay = self.layers[layer]
        lay.keys, lay.values, lay.positions, lay.seen = keys, values, positions, seen
        lay.is_initialized = True

    def nbytes(self) -> dict:
        data = meta = 0
        for lay in self.layers:
            if lay.keys is not None:
                data += lay.keys.numel() * lay.keys.element_size() + lay.values.numel() * lay.values.element_size()
                meta += lay.positions.numel() * lay.positions.element_size()
        return {"data": data, "metadata": meta, "total": data + meta}

    def kept_tokens(self, layer: int = 0) -> int:
        lay = self.layers[layer]
        return 0 if lay.keys is None else lay.keys.shape[2]



FILLER = -1   # the position of a slot that holds no token of its row (a left pad, or a filler
              # that keeps a padded batch's rows one length after they kept different numbers)


def real_slots(positions: torch.Tensor) -> torch.Tensor:
    """(B, H, n) indices of the slots holding a row's tokens (position >= 0), in slot order; every
    KV head of a row holds the same number (budgets are per layer)."""
    real = positions >= 0
    counts = real.sum(-1)
    if not bool((counts == counts[..., :1]).all()):
        raise RuntimeError(f"a row's KV heads hold different numbers of tokens ({counts.tolist()})")
    return real.nonzero()[:, -1].view(*positions.shape[:2], -1)


def gather_slots(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """`t` (B, H, S, d) at slot indices `idx` (B, H, n)."""
    return t.gather(2, idx[..., None].expand(-1, -1, -1, t.shape[-1]))


def slots_of(held: torch.Tensor, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(B, H, n) slot indices of the held tokens, rows holding fewer than the most led by filler
    slots, and the (B, H, n) filler flags; None when every slot is held. `width`: the most tokens
    a row holds, if the host knows it (`SubsetPolicy.padded_width`: no wait for the device; a
    width of every slot means no row drops a token of its own, only pads and fillers, which stay)."""
    S = held.shape[-1]
    if width is None:
        if bool(held.all()):
            return None
        width = int(held.sum(-1).max())
    elif width >= S:
        return None
    counts = held.sum(-1)                                            # (B, H)
    # held slots sort last, in slot order: a stable sort of the flags
    order = torch.sort(held.to(torch.int8), dim=-1, stable=True).indices[..., -width:]
    fillers = torch.arange(width, device=held.device) < (width - counts)[..., None]   # (B, H, n)
    return order, fillers
