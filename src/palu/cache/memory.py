"""Measured KV-cache memory of a real prefill through a method's cache."""
from __future__ import annotations

import torch

from ..models.adapters import geometry_of


@torch.no_grad()
def prefill_nbytes(model, method, input_ids: torch.Tensor) -> dict:
    """Bytes `method`'s cache really holds after prefilling `input_ids` into a fresh one
    (`method.cache_nbytes`: data, metadata such as scales and positions, total)."""
    cache = method.make_cache(model)
    model(input_ids, past_key_values=cache, use_cache=True)
    return method.cache_nbytes(cache)


def one_row(nbytes: dict, batch: int) -> dict:
    """`cache_nbytes` of a cache holding `batch` rows of equal length, as one row's: what does not
    grow with rows (`fixed`: per-layer codebooks, inside metadata and total) once, the rest split
    evenly (every other byte belongs to one token of one row; equal rows hold equal bytes)."""
    if batch == 1:
        return dict(nbytes)
    fixed = nbytes.get("fixed", 0)
    out = {}
    for key, value in nbytes.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or key == "fixed":
            out[key] = value
        elif key in ("metadata", "total"):
            out[key] = fixed + (value - fixed) / batch
        else:
            out[key] = value / batch
    return out


def fp16_equivalent(nbytes: dict, element_size: int) -> float:
    """The same cache with what it keeps in the model's dtype in fp16 (unpacked data, exact
    window / sink tokens); packed data and metadata (already fp16 / integers) as stored."""
    data = nbytes["data"] if nbytes.get("packed") else nbytes["data"] * 2 / element_size
    return data + nbytes["metadata"] + nbytes.get("full_precision", 0) * 2 / element_size


def bytes_summary(nbytes: dict, element_size: int, model_config, tokens: int, batch: int = 1) -> dict:
    """Honest bytes of a filled cache holding `tokens` tokens of `batch` sequences: as stored,
    as it would be with fp16 where the model's dtype is kept, the effective bits per original
    K/V element (from the fp16-equivalent bytes, metadata included) and the ratio to FP16."""
    geom = geometry_of(model_config)
    elements = batch * tokens * geom.num_layers * geom.kv_size()
    fp16 = fp16_equivalent(nbytes, element_size)
    bits = 8 * fp16 / elements
    return {"cache_bytes": int(nbytes["total"]), "cache_bytes_fp16": float(fp16),
            "cache_data_bytes": int(nbytes["data"]), "cache_metadata_bytes": int(nbytes["metadata"]),
            "cache_full_precision_bytes": int(nbytes.get("full_precision", 0)),
            "cache_tokens": int(tokens), "effective_bits": bits, "compression_vs_fp16": 16 / bits}
