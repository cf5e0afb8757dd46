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

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class SubsetPolicy:
    """What a token-subset method decides. Subclasses override `keep` (and `visible`)."""

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """(..., T, S) bool: query at q_pos (T,) may see key at k_pos (..., S). Causal by default."""
        return k_pos[..., None, :] <= q_pos[:, None]

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

    def map_rows(self, layer: int, fn) -> None:
        """Apply `fn` (a reordering, repetition or selection of the batch axis, dim 0) to any state
        the policy holds per row of `layer` (H2O's accumulated scores); default: none held."""


class _SubsetLayer(CacheLayerMixin):
    is_sliding = False
    is_croppable = False

    def __init__(self):
        super().__init__()
        self.keys = self.values = self.positions = None
        self.seen = 0

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

    def reorder_cache(self, beam_idx) -> None:
        self.map_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.map_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices) -> None:
        self.map_rows(lambda t: t[indices])


class SubsetKVCache(Cache):
    """The kept keys / values / positions per layer, and how many tokens each layer has seen."""

    def __init__(self, policy: SubsetPolicy, num_layers: int, owner: str):
        super().__init__(layers=[_SubsetLayer() for _ in range(num_layers)])
        self.policy, self.owner = policy, owner

    def _map_rows(self, fn) -> None:
        for i, lay in enumerate(self.layers):
            lay.map_rows(fn)
            self.policy.map_rows(i, fn)

    def reorder_cache(self, beam_idx) -> None:
        """Beam search: every layer's rows and the policy's per-row state follow `beam_idx`."""
        self._map_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices) -> None:
        self._map_rows(lambda t: t[indices])

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

