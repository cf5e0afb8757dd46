"""The cache_memory table: each method's measured cache bytes at a long prefill and its greedy
text (from the generate step's JSON files)."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from palu.artifacts import read_json
from palu.pipeline.reporting import write_frame

COLUMNS = ["method", "context", "dtype", "cache_bytes", "cache_bytes_fp16", "effective_bits",
           "ratio_vs_fp16", "cache_data_bytes", "cache_metadata_bytes", "cache_full_precision_bytes",
           "text", "prompt"]


def memory_table(paths: list[str]) -> pd.DataFrame:
    """One row per method; the fp16 run (transformers' DynamicCache) is the reference."""
    if not paths:
        raise ValueError("no generate results given to build the cache_memory table from")
    frame = pd.DataFrame([read_json(p)["result"] for p in paths])
    needed = set(COLUMNS) - {"ratio_vs_fp16"}
    missing = sorted(needed - set(frame.columns))
    if missing:
        raise ValueError(f"generate results without {missing} (run the generate step again): {paths}")
    for key in ("context", "prompt"):
        if frame[key].nunique() != 1:
            raise ValueError(f"cache_memory rows with different {key}s {sorted(set(frame[key]))}: {paths}")
    if "fp16" not in set(frame["method"]):
        raise ValueError(f"cache_memory needs the fp16 run as its reference: {paths}")
    fp = frame.loc[frame["method"] == "fp16", "cache_bytes_fp16"].iloc[0]
    frame["ratio_vs_fp16"] = frame["cache_bytes_fp16"] / fp
    return frame[COLUMNS].sort_values("effective_bits", ascending=False).reset_index(drop=True)


def to_markdown(frame: pd.DataFrame) -> str:
    mib = 2 ** 20
    r0 = frame.iloc[0]
    lines = [f"# KV-cache memory at {r0['context']} tokens (measured from real caches, "
             f"{r0['dtype']} model)\n",
             "Bytes of each method's cache after one prefill: packed codes, metadata (scales, "
             "minima, norms, outliers and their indices, codebooks, positions) and the tokens kept "
             "exact. fp16-equivalent: what is kept in the model's dtype counted at 2 bytes.\n",
             "| method | bytes as stored | fp16-equivalent MiB | bits / element | of FP16 |",
             "|---|---:|---:|---:|---:|"]
    for _, r in frame.iterrows():
        lines.append(f"| {r['method']} | {r['cache_bytes']} | {r['cache_bytes_fp16'] / mib:.2f} | "
                     f"{r['effective_bits']:.3f} | {r['ratio_vs_fp16']:.4f} |")
    lines += ["", f"## Greedy generation (prompt: {r0['prompt']!r})", ""]
    lines += [f"- {r['method']}: {r['text']!r}" for _, r in frame.iterrows()]
    return "\n".join(lines) + "\n"


def write_memory_table(paths: list[str], prefix: str | Path) -> pd.DataFrame:
    frame = memory_table(paths)
    return write_frame(frame, prefix, to_markdown(frame))
