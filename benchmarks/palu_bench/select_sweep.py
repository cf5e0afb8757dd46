"""Launch parameters of the latent-selection scoring and radix top-k kernels (issue 39 item 3),
timed alone on the H200 (CUDA-graph replays over L2-rotated sketch copies; the scores the top-k
reads are the step's own, so they are timed from L2 as in the step):

  python -m palu_bench.select_sweep OUT.json [scores,topk,attend]
Rows (of the parts named; default all): `sketch_scores_fused` by block_t and num_warps (with the
first-pass histogram or without), `select_attend` by splits, tiles, warps, early value gathers and
merge (over L2-rotated choices of tokens), and `radix_topk` by max_chunks and min_block, at
llama2-7b (32 KV heads) and llama3-8b (8) shapes, 64K.
"""
from __future__ import annotations

import json
import math
import os
import sys

import torch
import triton

from .timing import bench_rotated

SHAPES = {"llama2-7b": (32, 32), "llama3-8b": (32, 8)}   # query heads, KV heads
T, D, RANK, SKETCH, WINDOW, TOKENS = 65536, 128, 64, 16, 32, 1024


def main(out: str, parts=("scores", "topk", "attend")) -> None:
    from palu_kernels import select_topk as st
    rows = []
    for name, (H, G) in SHAPES.items():
        copies = max(1, math.ceil(4 * 60e6 / (G * T * SKETCH * 2)))
        gen = torch.Generator(device="cuda").manual_seed(0)
        cases = [{"q": torch.randn(1, H, D, device="cuda", dtype=torch.float16, generator=gen),
                  "bk": torch.randn(G, D, RANK, device="cuda", dtype=torch.float16, generator=gen) / 8,
                  "sk": torch.randn(1, G, T, SKETCH, device="cuda", dtype=torch.float16, generator=gen)}
                 for _ in range(copies)]
        for block_t, warps, with_hist in [(1024, 4, True), (2048, 8, True), (1024, 4, False)] * ("scores" in parts):
            def score(c, block_t=block_t, warps=warps, with_hist=with_hist):
                sc = torch.empty(1, G, T, device="cuda", dtype=torch.float16)
                hist = torch.zeros(1, G, 256, device="cuda", dtype=torch.int32)
                st._sketch_scores[(G, triton.cdiv(T, block_t))](
                    c["q"].reshape(H, D), c["bk"], c["sk"], sc, hist, T, T - WINDOW,
                    c["sk"].stride(1), c["sk"].stride(2), G, REP=H // G, D=D, R=RANK, SKETCH=SKETCH,
                    BLOCK_T=block_t, WITH_HIST=with_hist, num_warps=warps)
                return sc, hist
            t = bench_rotated([lambda c=c: score(c) for c in cases], 5, 10)
            gbs = G * T * SKETCH * 2 / t / 1e9
            rows.append({"shape": name, "kernel": "scores", "block_t": block_t, "warps": warps,
                         "histogram": with_hist, "time_s": t, "GB_per_s": gbs})
            print(f"{name} scores block_t={block_t} warps={warps} hist={with_hist}: {t * 1e6:.1f} us "
                  f"({gbs:.0f} GB/s)", flush=True)
        sc, hist = st.sketch_scores_fused(cases[0]["q"], cases[0]["bk"], cases[0]["sk"], H // G, window=WINDOW)
        want = sc[..., :T - WINDOW].float().topk(TOKENS, -1).values.sort(-1).values
        for chunks, min_block, atomic, ow in [(c, 256, False, w) for c in (32, 64) for w in (4, 8, 16)] * ("topk" in parts):
            fn = lambda: st.radix_topk(sc, TOKENS, WINDOW, hist=hist, max_chunks=chunks,  # noqa: E731
                                       min_block=min_block, atomic=atomic, offsets_warps=ow)
            got = sc[..., :T - WINDOW].float().gather(-1, fn()[..., :TOKENS]).sort(-1).values
            ok = bool(torch.equal(got, want))
            t = bench_rotated([fn], 5, 10)
            launches = []
            st.radix_topk(sc, TOKENS, WINDOW, hist=hist, max_chunks=chunks, min_block=min_block,
                          atomic=atomic, offsets_warps=ow, _parts=launches)
            times = [bench_rotated([f], 5, 10) for f in launches]
            rows.append({"shape": name, "kernel": "radix_topk", "max_chunks": chunks, "min_block": min_block,
                         "atomic": atomic, "offsets_warps": ow,
                         "block": max(min_block, triton.next_power_of_2(triton.cdiv(T - WINDOW, chunks))),
                         "time_s": t, "parts_s": dict(zip(("low_hist", "offsets", "emit"), times)),
                         "values_equal_torch_topk": ok})
            print(f"{name} topk chunks<={chunks} min_block={min_block} atomic={atomic} offsets_warps={ow}: "
                  f"{t * 1e6:.1f} us "
                  f"(low_hist {times[0] * 1e6:.1f}, offsets {times[1] * 1e6:.1f}, emit {times[2] * 1e6:.1f}), "
                  f"values equal: {ok}", flush=True)
        # the fused attend over the chosen tokens, by splits per KV head, tile, warps, early value
        # gathers and merge; rotated over enough random choices that their rows exceed L2
        from palu_kernels.select_attend import select_attend
        hk = torch.randn(1, G, T, RANK, device="cuda", dtype=torch.float16, generator=gen)
        hv = torch.randn(1, G, T, RANK, device="cuda", dtype=torch.float16, generator=gen)
        q_rot = torch.randn(1, H, D, device="cuda", dtype=torch.float16, generator=gen)
        inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device="cuda").float() / D))
        n = TOKENS + WINDOW
        sets = max(1, math.ceil(4 * 60e6 / (G * n * RANK * 2 * 2)))
        recent = torch.arange(T - WINDOW, T, device="cuda").expand(1, G, WINDOW)
        idxs = [torch.cat([torch.rand(1, G, T - WINDOW, device="cuda", generator=gen).topk(TOKENS, -1).indices
                           .sort(-1).values, recent], -1).contiguous() for _ in range(sets)]
        args = lambda idx: (q_rot, hk, hv, cases[0]["bk"], idx, inv, 1 / math.sqrt(D), H // G)  # noqa: E731
        ref = select_attend(*args(idxs[0]), torch_merge=True)
        grid = [(None, 64, 4, False, True)] + [(sp, bn, w, ev, False) for sp in (None, 8, 16, 32, 64)
                                               for bn, w, ev in ((64, 4, False), (64, 4, True), (32, 4, True),
                                                                 (32, 2, True), (16, 2, True), (64, 8, True))]
        for splits, block_n, warps, early_v, torch_merge in grid * ("attend" in parts):
            kw = dict(splits=splits, block_n=block_n, num_warps=warps, early_v=early_v, torch_merge=torch_merge)
            err = float((select_attend(*args(idxs[0]), **kw) - ref).norm() / ref.norm())
            t = bench_rotated([lambda i=i: select_attend(*args(i), **kw) for i in idxs], 5, 10)
            rows.append({"shape": name, "kernel": "select_attend", **kw, "index_sets": sets, "time_s": t,
                         "rel_err_vs_torch_merge": err})
            print(f"{name} attend splits={splits} block_n={block_n} warps={warps} early_v={early_v} "
                  f"merge={'torch' if torch_merge else 'kernel'}: {t * 1e6:.1f} us (rel. err {err:.1e})",
                  flush=True)
        if "topk" not in parts:
            continue
        t = bench_rotated([lambda: sc[..., :T - WINDOW].topk(TOKENS, -1, sorted=False)], 5, 10)
        rows.append({"shape": name, "kernel": "torch.topk", "time_s": t})
        print(f"{name} torch.topk: {t * 1e6:.1f} us", flush=True)
    info = {"device": torch.cuda.get_device_name(), "versions": {"torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda},
            "config": {"T": T, "rank": RANK, "sketch": SKETCH, "window": WINDOW, "tokens": TOKENS,
                       "shapes": SHAPES}, "rows": rows}
    with open(out + ".tmp", "w") as f:
        json.dump(info, f, indent=1)
    os.replace(out + ".tmp", out)


if __name__ == "__main__":
    main(sys.argv[1], *([tuple(sys.argv[2].split(","))] if len(sys.argv) > 2 else []))
