"""(rank, bits) allocation under a byte budget: `error_aware_bytes`.

Palu's cache holds r latents per token per block; stored at b bits they cost
packed_width(r, b) bytes plus an fp16 scale and zero point (4 bytes) per token, or 2 r bytes at
16 bits. A fixed byte budget can go to more ranks at fewer bits or fewer ranks at more bits, and
the best trade differs per layer. Per block (a Slot), for every rank r and width b, the
calibration output error splits into what the rank cut discards and what the quantiser adds:

    err(r, b) = sum_{i > r} sigma_i^2 E[z_i^2]  +  E || B_r (h - Q_b(h)) ||^2,   h = A_r x,

both measured on real projection inputs x of probe windows (z = V x, the block's whitened
coordinates, so the first term is the exact truncation error and the second the real quantiser's
error: `quantize_latent`, per token and group, min-max). The loss responds to a block's output
error by its output Fisher lambda (as in error_aware), times `key_weight` for keys.

Widths are per layer (a layer's K and V latents share one width: LatentCache(bits=[...]) stores
layers at different widths), ranks per block. The allocation minimises sum lambda * err under
sum bytes <= budget by a Lagrange multiplier mu (each layer takes the width, and each of its
blocks the rank, that minimise loss + mu * bytes; bisection on mu), then spends what the budget
has left on the single moves of best marginal loss per byte (the `greedy_by_gain` rule with
bytes as the unit). The budget is a fraction of the FP16 cache's latent-free bytes:
`byte_ratio` * (layers * kv_size * 2 bytes) per token (kv_size: K and V); the int32 positions the cache keeps
(4 bytes per token and layer) are the same for every allocation and not counted against it.
"""
from __future__ import annotations

import math

import torch

from palu.quant.packed import dequantize_latent, packed_width, quantize_latent

from ..models.adapters import adapter_for, geometry_of
from .ranks import Allocator, Slot, register_allocator, slots

BIT_OPTIONS = (16, 8, 4, 3, 2)
SCALE_BYTES = 4          # fp16 scale + zero point per token and quantisation group


def block_bytes(rank: int, bits: int) -> int:
    """Bytes per token that one block's latents take in the cache, metadata included."""
    return 2 * rank if bits == 16 else packed_width(rank, bits) + SCALE_BYTES


def byte_ratio(allocation: dict, widths: list[int]) -> float:
    """An allocation's latent + scale bytes per token at these per-layer widths over the FP16
    cache's (2 bytes for each of the `original_size` K/V numbers per token)."""
    used = sum(block_bytes(r["rank"], widths[r["layer"]]) for r in allocation["ranks"])
    return used / (2 * allocation["original_size"])


def uniform_byte_budget(geom, kept_ratio: float, group_size: int, multiple: int, bits: int) -> float:
    """The byte budget of uniform ranks at `kept_ratio` with every latent at `bits` (metadata
    included), as a fraction of the FP16 cache, to 5 decimals: the budget an error_aware_bytes
    allocation is given to compare with that uniform checkpoint at the same bytes. Uniform ranks
    read only the model's shape, so this is arithmetic on the config."""
    from .ranks import allocate
    uniform = allocate(geom, kept_ratio, group_size, "uniform", multiple)
    return round(byte_ratio(uniform, [bits] * geom.num_layers), 5)


@torch.no_grad()
def projection_inputs(model, windows: torch.Tensor, max_tokens: int = 2048) -> list[torch.Tensor]:
    """Per layer the K/V projections' input (tokens, hidden) in float64 on the probe windows,
    at most `max_tokens` of them."""
    adapter = adapter_for(model.config)
    layers = adapter.layers(model)
    hidden = model.config.hidden_size
    device = next(model.parameters()).device
    seen: list[list[torch.Tensor]] = [[] for _ in layers]
    hooks = []

    def make_hook(i):
        def hook(_module, args):
            seen[i].append(args[0].reshape(-1, hidden).double().cpu())
        return hook

    for i, layer in enumerate(layers):
        _, k_proj, _, _ = adapter.projections(adapter.attention(layer))
        hooks.append(k_proj.register_forward_pre_hook(make_hook(i)))
    try:
        for window in windows:
            model(input_ids=window[None].to(device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return [torch.cat(x)[:max_tokens] for x in seen]


@torch.no_grad()
def error_table(svds: dict, inputs: list[torch.Tensor], multiple: int,
                bit_options=BIT_OPTIONS) -> dict[Slot, torch.Tensor]:
    """{Slot: (units, len(bit_options)) float64}: mean per-token output error of the block at
    rank (u + 1) * multiple stored at each width (see the module docstring)."""
    out = {}
    for slot, (U, sigma, V) in svds.items():
        X = inputs[slot.layer]                         # (T, in)
        z = X @ V.T                                    # (T, d): W x = U diag(sigma) z
        energy = (sigma.pow(2) * z.pow(2).mean(0))     # per direction, mean over tokens
        tail = energy.flip(0).cumsum(0).flip(0)        # tail[r] = sum_{i >= r}
        d = sigma.numel()
        units = d // multiple
        table = torch.zeros(units, len(bit_options), dtype=torch.float64)
        for u in range(units):
            r = (u + 1) * multiple
            cut = float(tail[r]) if r < d else 0.0
            h = (z[:, :r] * sigma[:r].sqrt()).float()  # the latents A_r x
            for j, b in enumerate(bit_options):
                if b == 16:
                    q_err = 0.0                        # stored in the model's dtype
                else:
                    q = dequantize_latent(quantize_latent(h[None, None], b), torch.float32)[0, 0]
                    # B_r = U_r diag(sqrt sigma_r), U orthonormal: ||B_r e||^2 = sum sigma_i e_i^2
                    q_err = float(((h - q).double().pow(2) * sigma[:r]).sum(1).mean())
                table[u, j] = cut + q_err
        out[slot] = table
    return out


def _choose(weights, tables, bit_options, by_layer, mu, costs):
    """Per layer the width, per block the units, minimising loss + mu * bytes (`costs[j]`: the
    bytes of every rank at width j)."""
    choice = {}
    for layer, members in by_layer.items():
        best = None
        for j in range(len(bit_options)):
            total, picks = 0.0, {}
            for i in members:
                obj = weights[i] * tables[i][:, j] + mu * costs[j]
                u = int(torch.argmin(obj))
                picks[i] = u
                total += float(obj[u])
            if best is None or total < best[0]:
                best = (total, j, picks)
        choice[layer] = (best[1], best[2])
    return choice


def _bytes(choice, bit_options, multiple) -> int:
    return sum(block_bytes((u + 1) * multiple, bit_options[j]) for j, picks in choice.values()
               for u in picks.values())


def _loss(choice, weights, tables) -> float:
    return sum(weights[i] * float(tables[i][u, j]) for j, picks in choice.values() for i, u in picks.items())


def allocate_bytes(geom, byte_ratio: float, group_size: int, multiple: int, fisher: torch.Tensor,
                   tables: dict[Slot, torch.Tensor], bit_options=BIT_OPTIONS,
                   key_weight: float = 1.0) -> dict:
    """Ranks per block and a latent width per layer under `byte_ratio` of the FP16 cache's bytes
    (see the module docstring); `fisher` the output Fisher (layers, 2, kv_heads), `tables` from
    `error_table`. The allocation has allocate()'s fields plus `bits` (one width per layer) and
    the byte budget, target and realised."""
    if not 0 < byte_ratio <= 1:
        raise ValueError(f"byte ratio {byte_ratio} must lie in (0, 1]")
    stray = [b for b in bit_options if b not in BIT_OPTIONS]
    if not bit_options or stray:
        raise ValueError(f"bit options {stray or list(bit_options)} are not among {list(BIT_OPTIONS)}")
    all_slots = slots(geom, group_size)
    missing = [s for s in all_slots if s not in tables]
    if missing:
        raise ValueError(f"no error table for blocks {missing[:3]}")
    block = min(group_size * geom.head_dim, geom.hidden_size)
    if block % multiple:
        raise ValueError(f"rank_multiple={multiple} does not divide the full block rank {block}")
    fp16 = geom.num_layers * geom.kv_size() * 2
    budget = math.floor(byte_ratio * fp16 + 1e-9)
    weights = [float(fisher[s.layer, 0 if s.kind == "k" else 1,
                            s.group * group_size:(s.group + 1) * group_size].sum())
               * (key_weight if s.kind == "k" else 1.0) for s in all_slots]
    table = [tables[s] for s in all_slots]
    by_layer: dict[int, list[int]] = {}
    for i, s in enumerate(all_slots):
        by_layer.setdefault(s.layer, []).append(i)
    floor_bytes = len(all_slots) * block_bytes(multiple, min(bit_options))
    if budget < floor_bytes:
        raise ValueError(f"byte ratio {byte_ratio} leaves {budget} bytes per token for {len(all_slots)} "
                         f"blocks: less than {floor_bytes} (one rank multiple each at "
                         f"{min(bit_options)} bits); raise it")
    n_units = block // multiple       # every block has the same full rank
    costs = [torch.tensor([block_bytes((u + 1) * multiple, b) for u in range(n_units)], dtype=torch.float64)
             for b in bit_options]
    lo, hi = 0.0, 1.0
    while _bytes(_choose(weights, table, bit_options, by_layer, hi, costs), bit_options, multiple) > budget:
        hi *= 4
        if hi > 1e30:
            raise RuntimeError("byte allocation found no multiplier meeting the budget")
    for _ in range(60):          # the smallest multiplier whose choice fits
        mid = math.sqrt(lo * hi) if lo > 0 else hi / 1e6
        if _bytes(_choose(weights, table, bit_options, by_layer, mid, costs), bit_options, multiple) > budget:
            lo = mid
        else:
            hi = mid
    choice = _choose(weights, table, bit_options, by_layer, hi, costs)
    choice = {layer: (j, dict(picks)) for layer, (j, picks) in choice.items()}
    # top up: the move (one block one unit up, or one layer one width up) of best loss per byte
    while True:
        left = budget - _bytes(choice, bit_options, multiple)
        best = None
        for layer, (j, picks) in choice.items():
            for i, u in picks.items():
                if u + 1 < len(table[i]):
                    extra = block_bytes((u + 2) * multiple, bit_options[j]) - block_bytes((u + 1) * multiple, bit_options[j])
                    gain = weights[i] * float(table[i][u, j] - table[i][u + 1, j])
                    if 0 < extra <= left and gain > 0 and (best is None or gain / extra > best[0]):
                        best = (gain / extra, layer, i, None)
            wider = [k for k in range(len(bit_options)) if bit_options[k] > bit_options[j]]
            for k in wider:
                extra = sum(block_bytes((u + 1) * multiple, bit_options[k]) - block_bytes((u + 1) * multiple, bit_options[j])
                            for u in picks.values())
                gain = sum(weights[i] * float(table[i][u, j] - table[i][u, k]) for i, u in picks.items())
                if 0 < extra <= left and gain > 0 and (best is None or gain / extra > best[0]):
                    best = (gain / extra, layer, None, k)
        if best is None:
            break
        _, layer, i, k = best
        j, picks = choice[layer]
        if i is not None:
            picks[i] += 1
        else:
            choice[layer] = (k, picks)
    units = [0] * len(all_slots)
    bits = [16] * geom.num_layers
    for layer, (j, picks) in choice.items():
        bits[layer] = bit_options[j]
        for i, u in picks.items():
            units[i] = u + 1
    ranks = [u * multiple for u in units]
    used = _bytes(choice, bit_options, multiple)
    original = geom.num_layers * geom.kv_size()
    return {
        "method": "error_aware_bytes", "kept_ratio_target": byte_ratio, "group_size": group_size,
        "multiple": multiple, "original_size": original, "latent_size": sum(ranks),
        "kept_ratio_realised": sum(ranks) / original, "key_weight": float(key_weight),
        "byte_budget": {"ratio_target": byte_ratio, "bytes_per_token": budget, "fp16_bytes_per_token": fp16,
                        "used_bytes_per_token": used, "ratio_realised": used / fp16,
                        "bit_options": list(bit_options), "model_loss": _loss(choice, weights, table)},
        "bits": bits,
        "ranks": [{"layer": s.layer, "kind": s.kind, "group": s.group, "rank": r, "full": block}
                  for s, r in zip(all_slots, ranks)],
    }


def byte_allocation(model, svds: dict, fisher: torch.Tensor, byte_ratio: float, group_size: int,
                    multiple: int, windows: torch.Tensor, bit_options=BIT_OPTIONS,
                    key_weight: float = 1.0) -> dict:
    """`allocate_bytes` with its error tables measured on `windows` (probe windows: in the pipeline the first Fisher
    windows, which overlap the Gram's, results/checks/probe-window-overlap.json)."""
    geom = geometry_of(model.config)
    tables = error_table(svds, projection_inputs(model, windows), multiple, bit_options)
    allocation = allocate_bytes(geom, byte_ratio, group_size, multiple, fisher, tables, bit_options,
                                key_weight)
    allocation["byte_budget"]["probe"] = {"windows": int(len(windows)), "seqlen": int(windows.shape[1])}
    return allocation


def _probe(model, svds, fisher, byte_ratio, group_size, multiple, windows, key_weight) -> dict:
    return byte_allocation(model, svds, fisher, byte_ratio, group_size, multiple, windows)


register_allocator("error_aware_bytes", Allocator("output_fisher", probe=_probe))
