"""Latency rows of latent-space selection (issue 39 item 3): one decode step of
`palu_kernels.latent_select` (fold the query, score every token on a `sketch`-channel slice of its
key latent, top-k, rebuild and attend over the chosen tokens only), timed as the latency grid's
rows are (CUDA-graph replays over L2-rotated copies, speed-ups over the same run's best SDPA and
eager attention), with the step's three parts timed alone beside it.

Bytes per step: the sketch (every token's `sketch` channels), the scores written and read back
(fp16, twice for the chunked top-k), the chosen tokens' key and value latents, and the key factor.
"""
from __future__ import annotations

import math

import torch

from .cases import rope_inv_freq
from .timing import bench_rotated, rel_err, rotation_copies, speedups, timed_row


def selection_case(shape, B, T, rank, sketch, stored, seed=0, device="cuda"):
    H, G, D = shape["heads"], shape["kv_heads"], shape["head_dim"]
    g = torch.Generator(device=device).manual_seed(seed)
    hk = torch.randn(B, G, T, rank, device=device, dtype=torch.float16, generator=g)
    hv = torch.randn(B, G, T, rank, device=device, dtype=torch.float16, generator=g)
    bk = (torch.randn(G, D, rank, device=device, dtype=torch.float16, generator=g) / math.sqrt(rank))
    q = torch.randn(B, H, D, device=device, dtype=torch.float16, generator=g)
    sk = hk[..., :sketch].contiguous() if stored else None
    return {"q": q, "hk": hk, "hv": hv, "bk": bk, "sk": sk}


def step_counts(shape, B, T, rank, sketch, n, topk) -> dict:
    H, G, D = shape["heads"], shape["kv_heads"], shape["head_dim"]
    # fp16 scores written, then read back: once by torch.topk, twice by the chunked top-k, three
    # times (from L2) by the radix select's passes
    scores = B * G * T * 2 * {"chunked": 4, "radix": 4}.get(topk, 2)
    nbytes = (B * G * T * sketch * 2 + scores + B * G * n * 2 * rank * 2 + G * D * rank * 2
              + 2 * B * H * D * 2)
    flops = 2 * B * G * T * sketch + 2 * B * G * n * rank * D + 2 * B * H * n * (D + rank)
    return {"bytes": nbytes, "flops": flops}


def parse_fused(attend: str) -> tuple[int | None, dict]:
    """`fused[:SPLITS[:BLOCK_N:WARPS[:ev]]]` (SPLITS `auto`: the kernel's default, ~3 waves) -> (splits, the
    kernel's other launch options); any other attend: (None, {})."""
    parts = attend.split(":")
    if parts[0] != "fused":
        return None, {}
    if len(parts) not in (1, 2, 4, 5) or (len(parts) == 5 and parts[4] != "ev"):
        raise ValueError(f"attend {attend!r}: expected fused[:SPLITS[:BLOCK_N:WARPS[:ev]]]")
    splits = None if len(parts) == 1 or parts[1] == "auto" else int(parts[1])
    options = {"block_n": int(parts[2]), "num_warps": int(parts[3]), "early_v": len(parts) == 5} if len(parts) > 2 else {}
    return splits, options


def selection_rows(shape_name, shape, B, T, base, cfg, ceil, checks, log=print) -> list[dict]:
    from palu_kernels.latent_select import (attend_selected, attend_selected_sdpa, fold_query, rope_table,
                                            rotate_query, select_tokens, selection_decode, sketch_scores)
    from palu_kernels.reference import latent_decode_reference
    from palu_kernels.select_attend import select_attend
    sc = cfg["selection"]
    rank, window = int(sc["kept"] * shape["head_dim"]), sc["window"]
    n_rep, D = shape["heads"] // shape["kv_heads"], shape["head_dim"]
    inv_freq = rope_inv_freq(D, shape["rope_theta"], "cuda")
    w, r, rows = cfg["warmup_ms"], cfg["rep_ms"], []
    for stored in sc["stored_sketch"]:
        for sketch in sc["sketch"]:
            if stored and sketch >= rank:
                continue   # a stored sketch of every channel is a second copy of the key latents
            copies = rotation_copies(step_counts(shape, B, T, rank, sketch, sc["tokens"][0], "plain")["bytes"], cfg)
            cases = [selection_case(shape, B, T, rank, sketch, stored, seed) for seed in range(copies)]
            table = rope_table(T, inv_freq, torch.float16)   # the cache's, shared by the copies
            for c in cases:
                c["q_rot"] = rotate_query(c["q"], T, inv_freq).half()
            kw = dict(scale=1 / math.sqrt(D), n_rep=n_rep)
            if T == cfg["check_length"] and B == 1 and not stored and sketch == sc["sketch"][0]:
                c = cases[0]   # every token chosen: the same attention as the dense latent reference
                ref = latent_decode_reference(c["q_rot"], c["hk"], c["hv"], bk=c["bk"], group_size=1,
                                              inv_freq=inv_freq, position_offset=torch.zeros(B, device="cuda"),
                                              **kw)
                err = rel_err(lambda: selection_decode(c["q"], c["q_rot"], c["hk"], c["hv"], c["bk"], inv_freq,
                                                        tokens=T - window, window=window, sketch=sketch, **kw), ref)
                checks.append({"shape": shape_name, "variant": "select-all-tokens", "rel_err": err})
            for tokens, topk, attend in [(k, t, a) for k in sc["tokens"] if k + window < T
                                     for t in sc["topk"] for a in sc.get("attend", ["fp32"])]:
                splits, options = parse_fused(attend)

                def step(c, tokens=tokens, topk=topk, attend=attend, splits=splits, options=options):
                    return selection_decode(c["q"], c["q_rot"], c["hk"], c["hv"], c["bk"], inv_freq,
                                            tokens=tokens, window=window, sketch=sketch, topk=topk,
                                            sketch_latents=c["sk"], table=table if attend == "sdpa" else None,
                                            fused=attend.startswith("fused"), splits=splits,
                                            attend_options=options, **kw)
                name = f"select-{'stored' if stored else 'inplace'}-sk{sketch}-k{tokens}-{topk}-{attend}"
                try:
                    if topk != "plain" or attend != "fp32":   # the same tokens and output as the plain path
                        plain = selection_decode(cases[0]["q"], cases[0]["q_rot"], cases[0]["hk"], cases[0]["hv"],
                                                 cases[0]["bk"], inv_freq, tokens=tokens, window=window,
                                                 sketch=sketch, sketch_latents=cases[0]["sk"], **kw)
                        checks.append({"shape": shape_name, "length": T, "variant": name,
                                       "rel_err": rel_err(lambda: step(cases[0]), plain)})
                    if topk == "radix":   # the chosen scores are the k largest (torch.topk's values)
                        checks.append({"shape": shape_name, "length": T, "variant": name + "-topk-values",
                                       "rel_err": _radix_value_error(cases[0], tokens, window, sketch, kw)})
                    t = bench_rotated([lambda c=c: step(c) for c in cases], w, r)
                    attend_fn = {"fp32": attend_selected,
                                 "fused": lambda *a, **kw2: select_attend(*a, **kw2, splits=splits, **options),
                                 "sdpa": lambda q, a, b, k, i, _f, **kw2: attend_selected_sdpa(
                                     q, a, b, k, i, table, **kw2)}[attend.split(":")[0]]
                    parts = _parts(cases, tokens, topk, window, sketch, inv_freq, kw, w, r,
                                   fold_query, sketch_scores, select_tokens, attend_fn)
                except Exception as err:
                    rows.append({"variant": name, "shape": shape_name, "batch": B, "length": T,
                                 "error": f"{type(err).__name__}: {err}"[:300]})
                    log(f"{name} {shape_name} T={T}: FAILED {type(err).__name__}: {err}"[:300])
                    continue
                counts = {**step_counts(shape, B, T, rank, sketch, tokens + window, topk), "copies": copies}
                rows.append(timed_row(name, shape_name, B, T, t, counts, ceil, **speedups(t, base),
                                 rank_k=rank, rank_v=rank, tokens=tokens, window=window, sketch=sketch,
                                 topk=topk, attend=attend, stored_sketch=stored, rope=True, **parts))
                log(f"{name} {shape_name} T={T}: {t * 1e6:.1f} us ({base['sdpa'] / t:.2f}x SDPA; "
                    + ", ".join(f"{k[5:-2]} {v * 1e6:.1f}" for k, v in parts.items()) + ")")
            del cases
            torch.cuda.empty_cache()
    return rows


def _radix_value_error(c, tokens, window, sketch, kw) -> float:
    """Largest difference between the sorted scores `radix_topk` chose and torch.topk's."""
    from palu_kernels.select_topk import radix_topk, sketch_scores_fused
    sk = c["sk"] if c["sk"] is not None else c["hk"][..., :sketch]
    scores, hist = sketch_scores_fused(c["q"], c["bk"], sk, kw["n_rep"], window=window)
    older = scores[..., :scores.shape[-1] - window].float()
    got = older.gather(-1, radix_topk(scores, tokens, window, hist=hist)[..., :tokens]).sort(-1).values
    want = older.topk(tokens, -1).values.sort(-1).values
    return float((got - want).abs().max())


def _parts(cases, tokens, topk, window, sketch, inv_freq, kw, w, r,
           fold_query, sketch_scores, select_tokens, attend_selected) -> dict:
    """The step's parts timed alone over the same copies: scores (fold + sketch), top-k, attend."""
    if topk == "radix":     # the fold, the sketch scores and the top-k's first pass in one launch
        from palu_kernels.select_topk import radix_topk, sketch_scores_fused

        def score(c):
            return sketch_scores_fused(c["q"], c["bk"], c["sk"] if c["sk"] is not None
                                       else c["hk"][..., :sketch], kw["n_rep"], window=window)

        def select(c):
            return radix_topk(c["scores"][0], tokens, window, hist=c["scores"][1])
    else:
        def score(c):
            return sketch_scores(fold_query(c["q"], c["bk"], kw["n_rep"]),
                                 c["sk"] if c["sk"] is not None else c["hk"][..., :sketch])

        def select(c):
            return select_tokens(c["scores"], tokens, window, topk)
    for c in cases:
        c["scores"] = score(c)
        c["idx"] = select(c)
    out = {
        "part_scores_s": bench_rotated([lambda c=c: score(c) for c in cases], w, r),
        "part_topk_s": bench_rotated([lambda c=c: select(c) for c in cases], w, r),
        "part_attend_s": bench_rotated([lambda c=c: attend_selected(c["q_rot"], c["hk"], c["hv"], c["bk"],
                                                                     c["idx"], inv_freq, **kw) for c in cases], w, r),
    }
    for c in cases:
        del c["scores"], c["idx"]
    return out
