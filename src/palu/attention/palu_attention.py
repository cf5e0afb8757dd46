"""Palu attention: K/V projected to per-group latents, cached as latents, never stored full-size.

Reference (pure torch) backend. Per group g of `group_size` KV heads:
    hk = A_k[g] x,  hv = A_v[g] x                 (cached, pre-RoPE)
    keys   = RoPE(norm(B_k[g] hk + b_k))           (RoPE models; rebuilt at attention time; the
                                                   family's k-norm, if any, over the rebuilt keys)
    scores = (B_k[g]ᵀ q) · hk                      (no RoPE + fuse: keys never rebuilt)
    out    = Σ_i softmax_i · hv  @ (W_o,i B_v[g,i])ᵀ  (fuse: values never rebuilt)
Unfused paths rebuild K and V explicitly (the reference code's "simulated" Palu); both must agree.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import DynamicLayer

from ..cache.protocol import LatentStore, TensorLatents, left_pads
from ..models.adapters import FamilyAdapter, Geometry, apply_qk_norm
from .rope import apply_rope


def _sdpa(q, k, v, mask, scale: float, causal: bool):
    """SDPA where the value width may differ from the query/key width (latent values).

    torch's fused CPU/GPU kernels need one head width for q, k and v; otherwise it falls back to
    the materialising math path (8x slower here). Zero-padding the narrower side changes nothing:
    zero query/key columns add nothing to the scores, zero value columns are sliced off.
    """
    dq, dv = q.shape[-1], v.shape[-1]
    if dq < dv:
        q, k = F.pad(q, (0, dv - dq)), F.pad(k, (0, dv - dq))
    elif dv < dq:
        v = F.pad(v, (0, dq - dv))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=causal,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out[..., :dv]


def check_plain_cache(cache, layer_idx: int) -> None:
    """Only a cache that keeps every token as given can hold latents it does not know about: a
    sliding-window layer trims them (positions would no longer be 0..S-1), a static or quantised
    one rewrites them. Anything else is refused rather than read wrongly."""
    layers = getattr(cache, "layers", None)
    if layers is not None and layer_idx < len(layers):
        layer = type(layers[layer_idx])
    else:   # a cache built without a config appends layers of this class as they are reached
        layer = getattr(cache, "layer_class_to_replicate", None)
    if layer is not DynamicLayer or getattr(cache, "offloading", False):
        kind = getattr(layer, "__name__", type(cache).__name__)
        raise TypeError(f"Palu attention cannot use a {type(cache).__name__} ({kind} at layer "
                        f"{layer_idx}): it stores latents, which only palu.LatentCache (or a plain "
                        f"DynamicCache without sliding windows) holds correctly; pass "
                        f"past_key_values=palu.LatentCache(model)")


class PaluAttention(nn.Module):
    stores_latents = True   # how caches find Palu layers without importing this class

    def __init__(self, attn: nn.Module, adapter: FamilyAdapter, geom: Geometry, factors,
                 group_size: int, rotary: nn.Module | None = None, fuse: bool = True):
        super().__init__()
        q, k, v, o = adapter.projections(attn)
        self.layer_idx, self.geom, self.group_size, self.fuse = attn.layer_idx, geom, group_size, fuse
        self.backend = "auto"   # auto | triton | torch (see attention/kernel_backend.py)
        self.n_groups = geom.check_group_size(group_size)
        self.scaling = attn.scaling
        self.query_scaled = adapter.query_scaled_in_proj
        self.q_proj, self.o_proj = q, o
        # the family's q/k norms (modules of the model, kept: the original attention is dropped)
        self.q_norm, self.k_norm = adapter.norms(attn)
        self.qk_norm = adapter.qk_norm
        # keys are rebuilt from latents unless the fused query can score latents directly (no
        # RoPE and no k-norm: both act on the full key)
        self.rebuilds_keys = geom.rope or not fuse or self.k_norm is not None
        self._rotary = (rotary,)  # a tuple: shared with the model, not a submodule of ours
        self.selection = None
        self.eviction = None      # a stateless scorer (cache/eviction.py): what the layer keeps (palu_evict.py)
        self.eviction_owner = "Palu + eviction"   # the method's name, for errors
        dtype, device = q.weight.dtype, q.weight.device
        self.ranks_k, self.ranks_v = factors.ranks_k, factors.ranks_v
        cast = dict(dtype=dtype, device=device)
        self.register_buffer("A_k", torch.cat(factors.A_k).to(**cast))   # (R_k, hidden)
        self.register_buffer("A_v", torch.cat(factors.A_v).to(**cast))   # (R_v, hidden)
        self.register_buffer("k_bias", None if k.bias is None else k.bias.detach().clone())
        self.register_buffer("v_bias", None if v.bias is None else v.bias.detach().clone())
        for g in range(self.n_groups):
            self.register_buffer(f"B_k{g}", factors.B_k[g].to(**cast))
            self.register_buffer(f"B_v{g}", factors.B_v[g].to(**cast))
        if fuse:
            self._fuse_values(o, factors.B_v, v.bias, cast)
            if not self.rebuilds_keys:
                self._fuse_keys(q, factors.B_k, cast)

    # ---- offline fusion -------------------------------------------------------------------
    def _query_heads(self, g: int) -> range:
        per_group = self.group_size * self.geom.n_rep
        return range(g * per_group, (g + 1) * per_group)

    def _local_kv(self, head: int, g: int) -> slice:
        """Rows of B[g] that rebuild the KV head that query `head` reads."""
        j = head // self.geom.n_rep - g * self.group_size
        return slice(j * self.geom.head_dim, (j + 1) * self.geom.head_dim)

    def _fuse_values(self, o: nn.Linear, B_v, v_bias, cast) -> None:
        hd = self.geom.head_dim
        # detached: a fused buffer is a constant, not a graph back to o_proj's weight (training
        # anything else, e.g. LoRA recovery, would otherwise backpropagate into it every step)
        Wo = o.weight.detach().double()
        bias = o.bias.detach().double() if o.bias is not None else torch.zeros(Wo.shape[0], dtype=torch.float64,
                                                                         device=Wo.device)
        groups = []
        for g in range(self.n_groups):
            blocks = [Wo[:, i * hd:(i + 1) * hd] @ B_v[g][self._local_kv(i, g)].to(Wo)
                      for i in self._query_heads(g)]
            groups.append(torch.cat(blocks, 1))                           # (hidden, heads * r_g)
            if v_bias is not None:  # Σ_t p_t = 1, so the value bias passes through attention as is
                for i in self._query_heads(g):
                    kv = i // self.geom.n_rep
                    bias = bias + Wo[:, i * hd:(i + 1) * hd] @ v_bias.detach().double()[kv * hd:(kv + 1) * hd]
        # all groups side by side, (hidden, Σ_g heads_g * r_g): the decode kernels' latent outputs
        # (B, H, r) are in this order, so one matmul maps them (one per group cost 32 launches
        # per layer at M-LRD); `_wo(g)` is group g's column block
        self.register_buffer("Wo_fused", torch.cat(groups, 1).to(**cast))
        self.register_buffer("o_bias_fused", bias.to(**cast))

    def _fuse_keys(self, q: nn.Linear, B_k, cast) -> None:
        # q·(B h + b) = (Bᵀq)·h + q·b and q·b is the same for every key: softmax drops it.
        hd = self.geom.head_dim
        Wq = q.weight.detach().double()
        bq = q.bias.detach().double() if q.bias is not None else None
        weights, biases = [], []
        for g in range(self.n_groups):
            Bt = [B_k[g][self._local_kv(i, g)].to(Wq).T for i in self._query_heads(g)]  # (r, hd)
            weights.append(torch.cat([b @ Wq[i * hd:(i + 1) * hd] for b, i in zip(Bt, self._query_heads(g))]))
            if bq is not None:
                biases.append(torch.cat([b @ bq[i * hd:(i + 1) * hd] for b, i in zip(Bt, self._query_heads(g))]))
        # all groups stacked, (Σ_g heads_g * r_g, hidden): one projection gives every head's query
        self.register_buffer("Wq_fused", torch.cat(weights).to(**cast))
        self.register_buffer("bq_fused", torch.cat(biases).to(**cast) if biases else None)

    def _wo(self, g: int) -> torch.Tensor:
        """Group g's block of the fused output projection, (hidden, heads_g * r_g) (a view)."""
        start = sum(len(self._query_heads(h)) * self.ranks_v[h] for h in range(g))
        return self.Wo_fused[:, start:start + len(self._query_heads(g)) * self.ranks_v[g]]

    # ---- forward ------------------------------------------------------------------------------
    def forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                past_key_values=None, position_ids=None, **kwargs):
        B, T, _ = hidden_states.shape
        x = hidden_states
        hk, hv = F.linear(x, self.A_k), F.linear(x, self.A_v)          # (B, T, R)
        q = q_pre = None
        if self.rebuilds_keys:
            q = self.q_proj(x).view(B, T, self.geom.num_heads, -1).transpose(1, 2)  # (B, nh, T, hd)
            q = apply_qk_norm(q, self.q_norm, self.qk_norm)
            if self.query_scaled:
                q = q * self.scaling
            q_pre = q
            if self.geom.rope:
                cos, sin = position_embeddings
                q = apply_rope(q, cos, sin)
        if (self.selection is not None and T > 1 and past_key_values is not None
                and past_key_values.get_seq_length(self.layer_idx) > 0):
            raise ValueError("Palu latent-space selection chooses tokens for one-token decode steps: "
                             f"a {T}-token step after the prefill (assisted or prompt-lookup decoding "
                             "verifies drafted tokens so; a prompt prefilled in chunks) would attend to "
                             "every cached token. Prefill the prompt in one forward and decode one "
                             "token a step (no assistant_model / prompt_lookup_num_tokens)")
        evicting = self._evicts_after(B, T, past_key_values, attention_mask)   # before this step stores
        out, hk_all, hv_all, kpos, mask = self._cache_step(x, q, hk, hv, past_key_values, position_ids,
                                                           attention_mask, kernels=not evicting)
        if out is not None:   # the kernels served this step
            return out, None
        S = kpos.shape[-1]
        # with a k-norm over all heads every group's keys are needed at once; otherwise each group's
        # are rebuilt in turn (one group's keys in memory at a time)
        normed = self._normed_keys(hk_all) if self.k_norm is not None else None
        if self.geom.rope:   # the keys' rotation, for the torch path only (the kernels rotate on-chip)
            kcos, ksin = (cos, sin) if S == T and past_key_values is None else self._rope_for(kpos, x)
        select = self.selection if T == 1 and past_key_values is not None else None
        # a padded batch: a row chooses among its own tokens, and reads the chosen through its mask
        visible = None
        if select is not None and mask is not None:
            visible = mask[:, 0, -1] if mask.dtype == torch.bool else mask[:, 0, -1] > -1   # (B, S)
        scored = [] if evicting else None   # (queries, keys) of each group, for the eviction's scorer
        outs, heads = [], []
        v_off = 0
        for g in range(self.n_groups):
            hk_g = self._key_latents(hk_all, g)
            hv_g = hv_all[..., v_off:v_off + self.ranks_v[g]]
            v_off += self.ranks_v[g]
            qg = (q[:, self._query_heads(g).start:self._query_heads(g).stop] if self.rebuilds_keys
                  else self._fused_query(x, g))                                      # (B, h, T, hd | r)
            idx = None
            if select is not None:
                q_lat = select.query_latents(self, g, q_pre) if self.rebuilds_keys else qg
                idx = select.choose(q_lat, hk_g, visible)
            if idx is not None and select.recalls is not None:
                select.record(self._exact_probs(qg, hk_g, hk_all, normed, g, kcos if self.geom.rope else None,
                                                ksin if self.geom.rope else None), idx)
            gcos = gsin = None
            if self.geom.rope:
                gcos, gsin = kcos, ksin
            if idx is not None:                     # the chosen tokens only, at their positions
                hk_g = hk_g.gather(1, idx[..., None].expand(-1, -1, hk_g.shape[-1]))
                hv_g = hv_g.gather(1, idx[..., None].expand(-1, -1, hv_g.shape[-1]))
                if self.geom.rope:
                    gcos, gsin = self._rope_for(kpos.expand(B, -1).gather(1, idx), x)
            if self.rebuilds_keys:
                if normed is not None:
                    kg = normed[g]
                else:
                    kg = self._rebuild(hk_g, getattr(self, f"B_k{g}"), self.k_bias, g)   # (B, s, S, hd)
                if self.geom.rope:
                    kg = apply_rope(kg, gcos, gsin)
            else:
                kg = hk_g.unsqueeze(1)                                               # (B, 1, S, r)
            if self.fuse:
                vg = hv_g.unsqueeze(1).expand(B, kg.shape[1], hv_g.shape[1], hv_g.shape[-1])
            else:
                vg = self._rebuild(hv_g, getattr(self, f"B_v{g}"), self.v_bias, g)
            if scored is not None:
                scored.append((qg, kg))
            gmask = mask
            if idx is not None:   # the chosen tokens' columns of the mask (pads stay hidden)
                gmask = None if visible is None else visible.gather(1, idx)[:, None, None, :]
            z = _sdpa(qg, kg, vg, gmask, self._sdpa_scale(), causal=mask is None and T > 1)
            if self.fuse:   # (B, h, T, r) -> (B, T, hidden)
                outs.append(z.transpose(1, 2).reshape(B, T, -1) @ self._wo(g).T)
            else:
                heads.append(z)
        if scored is not None:
            self._evict(past_key_values.layers[self.layer_idx], scored, S, T)
        if self.fuse:
            return torch.stack(outs).sum(0) + self.o_bias_fused, None
        attn = torch.cat(heads, 1).transpose(1, 2).reshape(B, T, -1)                 # (B, T, nh*hd)
        return self.o_proj(attn), None

    def _evict(self, layer, scored, S: int, T: int) -> None:
        """After a step, hold what the eviction's scorer keeps (`cache/eviction.py`): one set per
        layer, its groups' latents sharing one token axis (every KV head's scores averaged). A
        left-padded batch (`layer.starts`: each row's first slot of its own tokens): each row
        scores and keeps among its own tokens with its own queries, as that prompt alone would;
        rows that keep fewer than the longest are led by masked filler slots (`layer.lead`)."""
        if self.rebuilds_keys:   # all heads at once: queries and keys in KV-head order
            scored = [(torch.cat([q for q, _ in scored], 1), torch.cat([k for _, k in scored], 1))]
        scale, scorer, starts = self._sdpa_scale(), self.eviction, layer.starts
        if starts is None:
            keep = scorer.keep_shared(self.layer_idx, scored, scale)
            if keep is not None:
                layer.evict(keep[:, 0], layer.get_seq_length())
            return
        keeps, changed = [], False
        for b, st in enumerate(starts):
            own = [(q[b:b + 1, :, max(0, T - (S - st)):], k[b:b + 1, :, st:]) for q, k in scored]
            got = scorer.keep_shared(self.layer_idx, own, scale)
            changed |= got is not None
            keeps.append(torch.arange(st, S, device=own[0][1].device) if got is None else got[0, 0] + st)
        if changed:
            n = max(len(k) for k in keeps)
            keep = torch.stack([torch.cat([k.new_zeros(n - len(k)), k]) for k in keeps])
            layer.evict(keep, layer.get_seq_length(), lead=[n - len(k) for k in keeps])

    def _evicts_after(self, B: int, T: int, cache, attention_mask) -> bool:
        """Whether this step ends with the eviction's scorer choosing what stays (after the
        prefill; every step for a scorer that evicts while decoding). At the prefill a left-padded
        batch's row starts are recorded (`layer.starts`), host-side, for every later eviction."""
        if self.eviction is None:
            return False
        if not isinstance(cache, LatentStore) or not hasattr(cache, "layers"):
            raise ValueError(f"{self.eviction_owner} evicts from a LatentCache (method.make_cache(model)); "
                             f"got {type(cache).__name__}")
        layer = cache.layers[self.layer_idx]
        held = layer.held_tokens()
        if held == 0:
            found = left_pads(attention_mask, B, T, self.eviction_owner)
            layer.starts = None if found is None else found.tolist()
        elif not self.eviction.keeps_after_prefill:
            return False
        # the fullest row holds every slot; a prompt within the budget keeps everything, as alone
        return self.eviction.evicts(self.layer_idx, held + T)

    def _kernels_may_run(self) -> bool:
        return self.fuse and self.backend != "torch" and self.selection is None

    def _cache_step(self, x, q, hk, hv, cache, position_ids, attention_mask, kernels: bool = True):
        """Store this step's latents in `cache` (a latent store, another Cache, or None) and, for
        a one-token step the kernels can serve, attend through them. Returns (output or None,
        and for the torch path: all latents, their positions, the mask)."""
        T = x.shape[1]
        stored = self._store(hk, hv, cache, position_ids, T, x.device)
        if T == 1 and kernels and self._kernels_may_run() and stored.cached and stored.kernel_layout:
            from .kernel_backend import can_use_kernel, kernel_decode
            if can_use_kernel(self, x, stored.kernel_mask(attention_mask, T), stored.bits) is None:
                keys, values = stored.kernel_latents(self.n_groups)
                out = kernel_decode(self, x, q, keys, values, **stored.kernel_positions())
                if out is not None:
                    return out, None, None, None, None
        hk_all, hv_all = stored.latents(x.dtype)
        return None, hk_all, hv_all, stored.positions, stored.mask(attention_mask, T)

    def _store(self, hk, hv, cache, position_ids, T, device):
        if isinstance(cache, LatentStore):
            return cache.store_latents(self.layer_idx, hk, hv, position_ids, (self.ranks_k, self.ranks_v))
        if cache is not None:  # an ordinary full DynamicCache stores the latents as one pseudo-head
            check_plain_cache(cache, self.layer_idx)
            k, v = cache.update(hk.unsqueeze(1), hv.unsqueeze(1), self.layer_idx)
            return TensorLatents(k.squeeze(1), v.squeeze(1),
                                 torch.arange(k.shape[-2], device=device)[None], cached=True)
        if getattr(self, "requires_cache", None):
            raise ValueError(f"{self.requires_cache}: a forward without its cache (use_cache=False, "
                             "or no past_key_values) would run it as 16-bit Palu with every token; "
                             "pass past_key_values=method.make_cache(model) (or method= to evaluate_text)")
        if position_ids is None:
            position_ids = torch.arange(T, device=device)[None]
        return TensorLatents(hk, hv, position_ids, cached=False)

    def _sdpa_scale(self) -> float:
        return 1.0 if self.query_scaled else self.scaling

    def _key_latents(self, hk_all, g: int) -> torch.Tensor:
        start = sum(self.ranks_k[:g])
        return hk_all[..., start:start + self.ranks_k[g]]

    def _exact_probs(self, qg, hk_g, hk_all, normed, g, kcos, ksin) -> torch.Tensor:
        """The exact attention of this step's queries over every cached token (for recall)."""
        if self.rebuilds_keys:
            kg = normed[g] if normed is not None else self._key(hk_all, g)
            if self.geom.rope:
                kg = apply_rope(kg, kcos, ksin)
            kg = kg.repeat_interleave(qg.shape[1] // kg.shape[1], 1)
        else:
            kg = hk_g.unsqueeze(1)
        return ((qg @ kg.transpose(-1, -2)) * self._sdpa_scale()).softmax(-1)

    def _key(self, hk_all, g: int) -> torch.Tensor:
        """Group g's keys (B, s, S, hd) rebuilt from their latents (before any norm and RoPE)."""
        return self._rebuild(self._key_latents(hk_all, g), getattr(self, f"B_k{g}"), self.k_bias, g)

    def _normed_keys(self, hk_all) -> list[torch.Tensor]:
        """Every group's rebuilt keys through the family's k-norm (over all KV heads at once
        where it normalises them jointly, OLMo-2), before RoPE."""
        keys = torch.cat([self._key(hk_all, g) for g in range(self.n_groups)], 1)
        return list(apply_qk_norm(keys, self.k_norm, self.qk_norm).split(self.group_size, 1))

    def _rebuild(self, h, Bg, bias, g):
        """Latents (B, S, r) -> full heads (B, s, S, hd) of group g."""
        Bsz, S, _ = h.shape
        y = h @ Bg.T
        if bias is not None:
            n = self.group_size * self.geom.head_dim
            y = y + bias[g * n:(g + 1) * n]
        return y.view(Bsz, S, self.group_size, self.geom.head_dim).transpose(1, 2)

    def _fused_query(self, x, g):
        """Group g's fused queries (B_kᵀ q per head), (B, heads_g, T, r_g)."""
        B, T, _ = x.shape
        start = sum(len(self._query_heads(h)) * self.ranks_k[h] for h in range(g))
        rows = slice(start, start + len(self._query_heads(g)) * self.ranks_k[g])
        bias = None if self.bq_fused is None else self.bq_fused[rows]
        q = F.linear(x, self.Wq_fused[rows], bias)
        if self.query_scaled:
            q = q * self.scaling
        return q.view(B, T, len(self._query_heads(g)), -1).transpose(1, 2)

    def _fused_queries(self, x):
        """Every head's fused query in one projection, (B, H, T, r); one key rank for all groups."""
        B, T, _ = x.shape
        q = F.linear(x, self.Wq_fused, self.bq_fused)
        if self.query_scaled:
            q = q * self.scaling
        return q.view(B, T, self.geom.num_heads, -1).transpose(1, 2)

    def _rope_for(self, positions, x):
        cos, sin = self._rotary[0](x, positions.long())
        return cos, sin
