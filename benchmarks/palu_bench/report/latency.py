"""Latency table and speed-up figure from the GPU benchmark JSON files (results/latency/*.json)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from palu.artifacts import atomic_path, read_json  # noqa: E402

COLUMNS = ["device", "shape", "batch", "length", "variant", "rope", "split", "group_size", "bits",
           "rank_k", "rank_v", "seconds", "speedup", "bytes", "flops", "tb_per_s", "tflop_per_s",
           "roofline_floor_s", "roofline_fraction", "error"]


def latency_frame(paths: list[str]) -> pd.DataFrame:
    """One row per configuration from the runs in `paths`. A configuration timed by several runs
    (a later run re-timing the rows a kernel change touched, or the KIVI run's own SDPA) keeps
    the newest run's row: each row's speed-up is over the SDPA of its own run."""
    runs = sorted((read_json(p) for p in paths), key=lambda run: run.get("created", ""), reverse=True)
    rows = []
    for run in runs:
        for r in run["rows"]:
            if r.get("variant") == "tune":
                continue
            rows.append({**r, "device": run["device"], "created": run.get("created", "")})
    if not rows:
        raise ValueError(f"no latency rows in {paths}")
    frame = pd.DataFrame(rows).reindex(columns=COLUMNS + ["created"])
    frame = frame.drop_duplicates(["shape", "batch", "length", "variant", "split", "group_size",
                                   "bits", "rope"], keep="first")
    return frame.sort_values(["shape", "batch", "length", "variant"], kind="stable").reset_index(drop=True)


def latency_markdown(frame: pd.DataFrame, ceilings: dict) -> str:
    ok = frame[frame["error"].isna()].copy()
    ok["us"] = ok["seconds"] * 1e6
    head = ok[(ok["batch"] == 1)].pivot_table(index=["shape", "variant"], columns="length",
                                               values="us", aggfunc="first")
    fails = frame[frame["error"].notna()][["shape", "length", "variant", "error"]].drop_duplicates("variant")
    return ("# Decode attention latency (µs, one query token, fp16)\n\n"
            f"Device ceilings measured in the same run: copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
            f"fp16 matmul {ceilings['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s. `speedup` is over torch "
            "SDPA on the same GPU in the same run. `int4_kv` is a 4-bit K/V cache with per-token "
            "groups through our latent kernel; `kivi-b4` / `kivi-b2` are KIVI caches (keys per "
            "channel in 32-token groups, values per token in 32-channel groups, the newest 128 "
            "tokens fp16) through the KIVI peer kernel (`palu_kernels/kivi.py`). Kernel "
            "times are CUDA-graph replays; Palu rows are the attention core only (the fused o_proj "
            "is not included). Full columns (bytes, FLOPs, TB/s, TFLOP/s, roofline) in latency.csv. "
            "A configuration timed by several runs shows the newest run's row (`created` in "
            "latency.csv); each row's speed-up is over the SDPA of its own run. `—`: not timed at "
            "that length (eager attention is not timed past 64K).\n\n"
            f"{_dash(head.reset_index().to_markdown(index=False, floatfmt='.1f'))}\n\n"
            "## Configurations the kernel rejects\n\n"
            f"{fails.to_markdown(index=False) if len(fails) else 'none'}\n")


def _dash(markdown: str) -> str:
    """A configuration not timed at a length reads `—`, not `nan` (same width: the columns stay)."""
    import re
    return re.sub(r"(?<=[| ])nan(?= *\|)", "  —", markdown)


def speedup_figure(frame: pd.DataFrame, out: str | Path) -> None:
    """Speed-up over SDPA against context, a panel per shape and RoPE / no RoPE: a line per latent
    width at its best group size, and a band spanning every group size timed (the spread the
    choice of group size makes; uniform K/V split, batch 1). Log scale: 0.5x and 2x are as far
    from parity."""
    ok = frame[frame["error"].isna() & (frame["batch"] == 1) & frame["variant"].str.startswith("palu")]
    shapes = sorted(ok["shape"].unique())
    fig, axes = plt.subplots(2, len(shapes), figsize=(6.5 * len(shapes), 7.6), squeeze=False, sharex=True)
    for col, shape in enumerate(shapes):
        for row, rope in enumerate((False, True)):
            ax = axes[row][col]
            sub = ok[(ok["shape"] == shape) & (ok["split"] == "uniform") & (ok["rope"].astype(bool) == rope)]
            for k, (bits, grp) in enumerate(sub.groupby("bits")):
                colour = plt.get_cmap("tab10")(k % 10)
                by = grp.groupby("length")["speedup"]
                ax.fill_between(by.min().index, by.min().values, by.max().values, color=colour, alpha=0.18, lw=0)
                ax.plot(by.max().index, by.max().values, marker="o", color=colour,
                        label=f"{'fp16' if bits == 16 else f'int{int(bits)}'} latents")
            ax.axhline(1.0, color="grey", ls="--", lw=1)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log", base=2)
            ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}x"))
            ax.set_ylabel("speed-up over torch SDPA")
            ax.set_title(f"{shape}, {'RoPE' if rope else 'no RoPE'}: Palu-50% decode attention", fontsize=10)
            ax.legend(fontsize=8, title="line: best group size; band: every group size", title_fontsize=7)
            if row == 1:
                ax.set_xlabel("context length (tokens)")
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, dpi=130, format="png")
    plt.close(fig)
