"""The rank search with and without kept layer outputs (`decompose/search._KeptPrefix`) on a real
model: the same search (every round's loss, the ranks, the evaluations) and its time each way.

    python benchmarks/experiments/search_kept_layers.py OUT.json MODEL GRAM FISHER \
        [kept=0.5] [group=3] [evaluations=60] [multiple=8]
    python benchmarks/experiments/search_kept_layers.py OUT.json MODEL --layers [repeats=3]

`--layers`: one evaluation's time by the first layer it runs (0, the middle, the last), against a
whole forward, with the loss each gives (equal: nothing is changed between them).

Windows: WINDOWS x WINDOW_TOKENS tokens cut in order from the embedded novels' evaluation text
(any text serves for this comparison; the pipeline's search reads held-out calibration text).

Measured 2026-12-05 (results/checks/search-kept-layers.json; SmolLM2, J-LRD kept 0.5, 40
evaluations, float32 on this machine's 2 cores): identical (every field of the allocation, the
final loss 0 apart); 1786 s whole forwards, 1589 s with kept layers, both sharing the cores with a
pipeline run (the times are not a clean ratio). At 40 evaluations 14 are probe_select's candidates
and the first loss, whole forwards either way; the marginals that follow skip the layers before
their block, half the body on average.
"""
from __future__ import annotations

import sys
import time

import torch

from palu.artifacts import write_json
from palu.calib.stats_file import load_stats
from palu.data.corpora import load_corpus
from palu.data.windows import tokenize
from palu.decompose.search import WINDOW_TOKENS, WINDOWS, search_ranks
from palu.decompose.spectra import whitened_svds
from palu.models.loading import load_model


def windows_of(tok) -> torch.Tensor:
    tokens = tokenize(tok, load_corpus("novels_standin").evaluation_text)
    return tokens[:WINDOWS * WINDOW_TOKENS].reshape(WINDOWS, WINDOW_TOKENS)


def by_first_layer(out: str, model_path: str, repeats: int) -> None:
    from palu.decompose.search import _KeptPrefix
    model, tok = load_model(model_path, dtype="float32", device="cpu")
    prefix = _KeptPrefix(model, windows_of(tok))
    L = len(prefix.layers)
    whole = prefix.loss(L)                     # a whole forward that keeps every layer's output
    rows = []
    for _ in range(repeats):                   # interleaved, so a slower stretch of the machine hits all
        for first in (0, L // 2, L - 1):
            t = time.perf_counter()
            loss = prefix.loss(first)
            rows.append({"first_layer": first, "seconds": time.perf_counter() - t, "loss_equal": loss == whole})
            print(rows[-1], flush=True)
    best = {f: min(r["seconds"] for r in rows if r["first_layer"] == f) for f in (0, L // 2, L - 1)}
    write_json(out, {"config": {"model": model_path, "layers": L, "windows": [WINDOWS, WINDOW_TOKENS],
                                "threads": torch.get_num_threads(), "repeats": repeats},
                     "rows": rows, "best_seconds": best,
                     "share_of_whole": {f: best[f] / best[0] for f in best},
                     "all_equal": all(r["loss_equal"] for r in rows)})
    print(f"share of a whole forward by first layer: {({f: round(best[f] / best[0], 3) for f in best})} -> {out}")


def main(argv: list[str]) -> None:
    if len(argv) >= 3 and argv[2] == "--layers":
        repeats = int(argv[3].partition("=")[2]) if len(argv) > 3 else 3
        return by_first_layer(argv[0], argv[1], repeats)
    out, model_path, gram, fisher = argv[:4]
    args = {"kept": 0.5, "group": 3, "evaluations": 60, "multiple": 8}
    for item in argv[4:]:
        key, _, value = item.partition("=")
        if key not in args:
            raise SystemExit(f"{item!r}: expected one of {sorted(args)}")
        args[key] = type(args[key])(value)
    model, tok = load_model(model_path, dtype="float32", device="cpu")
    windows = windows_of(tok)
    grams = load_stats(gram, "calibration Gram")[0]["gram"]
    stats = load_stats(fisher, "Fisher scores")[0]
    svds = whitened_svds(model, grams, args["group"])
    rows = {}
    for reuse in (False, True):
        t = time.perf_counter()
        found = search_ranks(model, svds, stats, args["kept"], args["group"], args["multiple"], windows,
                             evaluations=args["evaluations"], reuse_layers=reuse)
        rows[reuse] = (time.perf_counter() - t, found)
        print(f"reuse_layers={reuse}: {rows[reuse][0]:.1f} s, loss {found['search']['loss']:.6f}, "
              f"{found['search']['evaluations']} evaluations", flush=True)
    same = rows[True][1] == rows[False][1]
    diff = abs(rows[True][1]["search"]["loss"] - rows[False][1]["search"]["loss"])
    write_json(out, {"config": {**args, "model": model_path, "windows": [WINDOWS, WINDOW_TOKENS],
                                "threads": torch.get_num_threads()},
                     "seconds": {"whole_forward": rows[False][0], "kept_layers": rows[True][0]},
                     "speedup": rows[False][0] / rows[True][0], "identical": same, "final_loss_diff": diff,
                     "rounds": {"whole_forward": rows[False][1]["search"]["rounds"],
                                "kept_layers": rows[True][1]["search"]["rounds"]}})
    print(f"identical: {same} (final loss diff {diff:.3g}); speedup {rows[False][0] / rows[True][0]:.2f}x -> {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
