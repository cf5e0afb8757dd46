"""What differs between a CPU and a GPU result of the same step (issue 50, item 2): every run file
of the default grid (results/) beside its twin from the same grid on the H200 (results/h200/,
conf/grid/h200.yaml: same steps, samples and dtype float32, other arithmetic and batch sizes).

    python benchmarks/experiments/cpu_vs_gpu.py results results/h200 results/checks/h200-vs-cpu.json

Perplexity: relative difference of each run's ppl and the largest block-NLL difference;
zero-shot: documents whose predicted choice differs; long-context: answers that differ and the
score change; bytes: cache bytes that differ (they must not: the same tokens are stored)."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _pairs(cpu: Path, gpu: Path, folder: str):
    for g in sorted((gpu / folder).rglob("*.json")):
        c = cpu / folder / g.relative_to(gpu / folder)
        if c.is_file():
            yield str(g.relative_to(gpu / folder)), _load(c), _load(g)


def compare(cpu: Path, gpu: Path) -> dict:
    ppl, zs, lc, bytes_differ = [], [], [], []
    for rel, c, g in _pairs(cpu, gpu, "runs"):
        mc, mg = c["metrics"], g["metrics"]
        if "ppl" not in mc:
            continue
        ppl.append({"run": rel, "cpu": mc["ppl"], "gpu": mg["ppl"], "rel_diff": mg["ppl"] / mc["ppl"] - 1,
                    "max_block_nll_diff": max(abs(a - b) for a, b in zip(mc["block_nll"], mg["block_nll"]))})
        if mc.get("cache_bytes") != mg.get("cache_bytes"):
            bytes_differ.append(rel)
    for rel, c, g in _pairs(cpu, gpu, "zeroshot"):
        changed = total = 0
        for task, tc in c["zeroshot"]["tasks"].items():
            tg = g["zeroshot"]["tasks"][task]
            by_doc = {s["doc_id"]: s["pred"] for s in tg["samples"]}
            changed += sum(by_doc[s["doc_id"]] != s["pred"] for s in tc["samples"])
            total += len(tc["samples"])
        zs.append({"run": rel, "documents": total, "predictions_changed": changed})
    for rel, c, g in _pairs(cpu, gpu, "longcontext"):
        sc, sg = c["longcontext"]["samples"], g["longcontext"]["samples"]
        lc.append({"run": rel, "prompts": len(sc), "answers_changed": sum(a["answer"] != b["answer"] for a, b in zip(sc, sg)),
                   "score_cpu": sum(s["score"] for s in sc), "score_gpu": sum(s["score"] for s in sg),
                   # bytes where both files record them (older CPU files did not, per prompt)
                   "bytes_differ": sum(a["cache_bytes"] != b["cache_bytes"] for a, b in zip(sc, sg)
                                       if "cache_bytes" in a and "cache_bytes" in b)})
    rel = sorted(abs(p["rel_diff"]) for p in ppl)
    return {
        "perplexity": {"runs": len(ppl), "max_abs_rel_diff": rel[-1] if rel else None,
                       "median_abs_rel_diff": rel[len(rel) // 2] if rel else None, "rows": ppl},
        "cache_bytes_differ": bytes_differ,
        "zeroshot": {"runs": len(zs), "documents": sum(z["documents"] for z in zs),
                     "predictions_changed": sum(z["predictions_changed"] for z in zs), "rows": zs},
        "longcontext": {"runs": len(lc), "prompts": sum(r["prompts"] for r in lc),
                        "answers_changed": sum(r["answers_changed"] for r in lc),
                        "score_changed": [r["run"] for r in lc if r["score_cpu"] != r["score_gpu"]], "rows": lc},
    }


def main(argv=None) -> None:
    cpu, gpu, out = (Path(a) for a in (argv or sys.argv[1:]))
    result = compare(cpu, gpu)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    p, z, lc = result["perplexity"], result["zeroshot"], result["longcontext"]
    print(f"perplexity: {p['runs']} runs, |GPU/CPU - 1| median {p['median_abs_rel_diff']:.2e}, max {p['max_abs_rel_diff']:.2e}; "
          f"cache bytes differ in {len(result['cache_bytes_differ'])}")
    print(f"zero-shot: {z['runs']} runs, {z['predictions_changed']} of {z['documents']} predictions differ")
    print(f"long-context: {lc['runs']} runs, {lc['answers_changed']} of {lc['prompts']} answers differ; "
          f"score changed in {len(lc['score_changed'])}: {lc['score_changed']}")


if __name__ == "__main__":
    main()
