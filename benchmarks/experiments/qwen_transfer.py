"""The numbers the README's Qwen2.5-Coder-1.5B section quotes beside its tables, from the committed
run files (results/qwen25-coder-1.5b/runs): J-LRD against M-LRD paired on the same 128-token blocks
at each kept ratio and corpus, each row's cost relative to FP16, the Hadamard rotation against
none at each latent width, every quantisation row against FP16, KVQuant against Palu's latents at
the nearest bytes (paired), and in zero-shot accuracy 3-bit latents against none at kept 0.5 (paired sample by
sample, averaged over tasks as the zero-shot table averages).

    python benchmarks/experiments/qwen_transfer.py [results/qwen25-coder-1.5b]

prints markdown lines; reads nothing but the run files.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from palu.eval.stats import ppl_difference, ppl_interval, stratified_mean


def _one(root: Path, pattern: str) -> dict:
    files = sorted(root.glob(pattern))
    if len(files) != 1:
        raise SystemExit(f"{root}/{pattern}: {len(files)} run files, want exactly 1")
    return json.loads(files[0].read_text())["metrics"]


def _pair(a: dict, b: dict) -> str:
    d = ppl_difference(a["block_nll"], b["block_nll"], a["block_tokens"])
    return f"{d['diff']:+.2f} [{d['lo']:+.2f}, {d['hi']:+.2f}]"


def main(results: str = "results/qwen25-coder-1.5b") -> None:
    root = Path(results) / "runs" / "qwen25-coder-1.5b"
    print("| kept | corpus | M-LRD | J-LRD | J - M |")
    for corpus in ("wiki_standin", "novels_standin"):
        fp = _one(root, f"fp16/ppl-{corpus}-*.json")
        for k in ("0.7", "0.5", "0.3"):
            m = _one(root, f"palu-whitened-uniform-k{k}-g1/*/*/ppl-{corpus}-*.json")
            j = _one(root, f"palu-whitened-uniform-k{k}-g2/*/*/ppl-{corpus}-*.json")
            print(f"| {k} | {corpus} | {m['ppl']:.2f} ({m['ppl'] / fp['ppl'] - 1:+.0%}) | "
                  f"{j['ppl']:.2f} ({j['ppl'] / fp['ppl'] - 1:+.0%}) | {_pair(j, m)} |")
    print("\n| kept | bits | plain | Hadamard | Hadamard - plain |")
    for k in ("0.7", "0.5"):
        for b in (4, 3, 2):
            plain = _one(root, f"palu-whitened-uniform-k{k}-g2-b{b}/*/*/ppl-wiki_standin-*.json")
            rot = _one(root, f"palu-whitened-uniform-k{k}-g2-rot_hadamard-s0-b{b}/*/*/ppl-wiki_standin-*.json")
            print(f"| {k} | {b} | {plain['ppl']:.2f} | {rot['ppl']:.2f} | {_pair(rot, plain)} |")
    print("\n| run (wiki) | bits / element | ppl [95 %] | vs FP16 |")
    fp = _one(root, "fp16/ppl-wiki_standin-*.json")
    for f in sorted(root.rglob("ppl-wiki_standin-*.json")):
        m = json.loads(f.read_text())["metrics"]
        if m["run"] == "fp16":
            continue
        lo, hi = ppl_interval(m["block_nll"], m["block_tokens"])
        print(f"| {m['run']} | {m['effective_bits']:.2f} | {m['ppl']:.2f} [{lo:.2f}, {hi:.2f}] | {_pair(m, fp)} |")
    print("\n| KVQuant (wiki) | bits | Palu J-LRD at the nearest bytes | bits | KVQuant - Palu |")
    for b, palu in ((4, "palu-whitened-uniform-k0.7-g2-b4"), (3, "palu-whitened-uniform-k0.7-g2-b4"),
                    (2, "palu-whitened-uniform-k0.7-g2-rot_hadamard-s0-b3")):
        kv = _one(root, f"kvquant-b{b}-fisher-o0.01/*/ppl-wiki_standin-*.json")
        pl = _one(root, f"{palu}/*/*/ppl-wiki_standin-*.json")
        print(f"| {kv['run']} | {kv['effective_bits']:.2f} | {pl['run']} | {pl['effective_bits']:.2f} | {_pair(kv, pl)} |")
    zs = Path(results) / "zeroshot" / "qwen25-coder-1.5b"

    def accuracies(run: str) -> list[list[float]]:
        files = sorted(zs.glob(f"{run}/*/*/zeroshot-*.json"))
        if len(files) != 1:
            raise SystemExit(f"{zs}/{run}: {len(files)} zero-shot files, want exactly 1")
        tasks = json.loads(files[0].read_text())["zeroshot"]["tasks"]
        return [[s["acc"] for s in tasks[t]["samples"]] for t in sorted(tasks)]
    d = stratified_mean(accuracies("palu-whitened-uniform-k0.5-g2-b3"),
                        reference=accuracies("palu-whitened-uniform-k0.5-g2"))
    print(f"\nzero-shot, 3-bit latents - none at kept 0.5 (J-LRD), average over tasks: "
          f"{100 * d['value']:+.1f} [{100 * d['lo']:+.1f}, {100 * d['hi']:+.1f}] points, sign test p = {d['p_sign']:.3g}")


if __name__ == "__main__":
    main(*sys.argv[1:])
