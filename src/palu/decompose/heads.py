"""KV heads reordered by similarity before G-LRD groups them (ReCalKV's head reordering).

G-LRD factorises consecutive KV heads jointly, so which heads share a group is an accident of
their index. Heads whose outputs span similar subspaces share a low-rank basis better. Per layer
the similarity of heads i and j is the linear CKA of their outputs on the calibration inputs,
from the Gram G = X^T X alone (uncentred): ||W_i G W_j^T||_F^2 / (||W_i G W_i^T||_F ||W_j G W_j^T||_F),
averaged over keys and values. Groups are formed greedily: the lowest unassigned head, then the
unassigned heads most similar to the group so far, until it has `group_size`.

A reorder permutes the KV heads (the K/V projection rows) together with their query heads (Q
rows) and the output projection's columns, so the model computes exactly the same function; the
checkpoint records the order, and `load_compressed` applies it to the base model before
installing the factors. With group size 1 (M-LRD) or all heads (J-LRD) the grouping is the same
in every order, so the order is the identity and nothing changes.
"""
from __future__ import annotations

import torch

from ..models.adapters import adapter_for, geometry_of

HEAD_ORDERS = ("none", "similarity")


def head_similarity(W: torch.Tensor, gram: torch.Tensor, heads: int) -> torch.Tensor:
    """(heads, heads) linear CKA of the heads' outputs, W (heads * d, in), gram (in, in)."""
    Wh = W.double().reshape(heads, -1, W.shape[-1])
    cross = torch.einsum("hdi,ij,gej->hgde", Wh, gram.double(), Wh)      # W_h G W_g^T
    energy = cross.pow(2).sum((-1, -2))
    norm = energy.diagonal().sqrt()
    return energy / (norm[:, None] * norm[None, :]).clamp_min(1e-300)


def group_order(similarity: torch.Tensor, group_size: int) -> list[int]:
    """Heads in group order: each group the lowest unassigned head plus the unassigned heads of
    highest mean similarity to the group so far (ties: the lower index)."""
    n = similarity.shape[0]
    if n % group_size:
        raise ValueError(f"group_size={group_size} does not divide {n} heads")
    if group_size in (1, n):
        return list(range(n))
    left, order = list(range(n)), []
    while left:
        group = [left.pop(0)]
        while len(group) < group_size:
            best = max(left, key=lambda h: (float(similarity[h, group].mean()), -h))
            left.remove(best)
            group.append(best)
        order += group
    return order


@torch.no_grad()
def similarity_orders(model, grams: torch.Tensor, group_size: int) -> list[list[int]]:
    """Per layer the KV-head order that groups similar heads (keys' and values' CKA averaged)."""
    adapter, geom = adapter_for(model.config), geometry_of(model.config)
    geom.check_group_size(group_size)
    orders = []
    for l, layer in enumerate(adapter.layers(model)):
        _, k, v, _ = adapter.projections(adapter.attention(layer))
        sim = (head_similarity(k.weight, grams[l], geom.num_kv_heads)
               + head_similarity(v.weight, grams[l], geom.num_kv_heads)) / 2
        orders.append(group_order(sim, group_size))
    return orders


def _take_rows(linear, order: list[int], blocks: int) -> None:
    """Permute `blocks` equal row blocks of a Linear (and its bias) into `order`."""
    idx = torch.tensor(order)
    w = linear.weight.data
    linear.weight.data = w.reshape(blocks, -1, w.shape[-1])[idx].reshape_as(w).contiguous()
    if linear.bias is not None:
        b = linear.bias.data
        linear.bias.data = b.reshape(blocks, -1)[idx].reshape_as(b).contiguous()


@torch.no_grad()
def reorder_heads(model, orders: list[list[int]]) -> None:
    """Permute every layer's KV heads into `orders[l]` (new head i = old head orders[l][i]), with
    their query heads and output columns: the same function, other head indices. In place."""
    adapter, geom = adapter_for(model.config), geometry_of(model.config)
    layers = adapter.layers(model)
    if len(orders) != len(layers):
        raise ValueError(f"{len(orders)} head orders for a model of {len(layers)} layers")
    for l, (layer, order) in enumerate(zip(layers, orders)):
        if sorted(order) != list(range(geom.num_kv_heads)):
            raise ValueError(f"layer {l}: head order {order} is not a permutation of "
                             f"{geom.num_kv_heads} KV heads")
        if order == list(range(geom.num_kv_heads)):
            continue
        attn = adapter.attention(layer)
        q, k, v, o = adapter.projections(attn)
        _take_rows(k, order, geom.num_kv_heads)
        _take_rows(v, order, geom.num_kv_heads)
        _take_rows(q, order, geom.num_kv_heads)            # each KV head's n_rep query heads
        if adapter.qk_norm == "all":     # OLMo-2: a weight per q / k dim, of every head: permuted too
            for norm in adapter.norms(attn):
                norm.weight.data = (norm.weight.data.reshape(geom.num_kv_heads, -1)[torch.tensor(order)]
                                    .reshape(-1).contiguous())
        w = o.weight.data                                   # (out, heads * d): columns by head
        idx = torch.tensor(order)
        o.weight.data = (w.reshape(w.shape[0], geom.num_kv_heads, -1)[:, idx].reshape_as(w)
                         .contiguous())


def permute_statistics(stats: dict, orders: list[list[int]]) -> dict:
    """Per-head statistics (layers, 2, kv_heads) in the reordered heads' order (others as they are)."""
    idx = torch.tensor(orders)                              # (layers, kv_heads)
    out = {}
    for key, t in stats.items():
        if isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[0] == idx.shape[0] \
                and t.shape[2] == idx.shape[1]:
            out[key] = torch.gather(t, 2, idx[:, None, :].expand(-1, t.shape[1], -1))
        else:
            out[key] = t
    return out


def check_head_order(head_order: str, geom, group_size: int) -> None:
    """A similarity order only means something for G-LRD (1 < group size < KV heads)."""
    if head_order not in HEAD_ORDERS:
        raise ValueError(f"head_order={head_order!r} is not one of {HEAD_ORDERS}")
    if head_order != "none" and group_size in (1, geom.num_kv_heads):
        raise ValueError(f"head_order={head_order!r} groups KV heads for G-LRD; with group_size="
                         f"{group_size} (of {geom.num_kv_heads} KV heads: M-LRD or J-LRD) every "
                         "order gives the same factors: use head_order=none")
