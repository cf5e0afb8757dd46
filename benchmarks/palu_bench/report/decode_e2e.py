"""End-to-end decode table and memory/latency-vs-context figure (results/decode/*.json)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from palu.artifacts import atomic_path, read_json  # noqa: E402

COLUMNS = ["device", "variant", "rope", "baseline", "batch", "context", "group_size", "rank_k", "rank_v",
           "bits", "seconds_per_token", "speedup", "peak_bytes", "weight_bytes", "cache_bytes",
           "bytes_per_token", "flops_per_token", "tb_per_s", "tflop_per_s", "roofline_floor_s",
           "roofline_fraction", "error"]


def _with_rates(row: dict, run: dict) -> dict:
    """Add the achieved TB/s and TFLOP/s and the roofline floor max(bytes / copy bandwidth,
    FLOPs / matmul rate), both ceilings measured in the run. Every input is in the JSON (the
    benchmark writes each row's bytes and analytic FLOPs), so no benchmark code is imported."""
    if "error" in row:
        return row
    flops, ceil, t = row["flops_per_token"], run["ceilings"], row["seconds_per_token"]
    floor = max(row["bytes_per_token"] / ceil["copy_bytes_per_s"], flops / ceil["matmul_flops_per_s"])
    return {**row, "tb_per_s": row["bytes_per_token"] / t / 1e12,
            "tflop_per_s": flops / t / 1e12, "roofline_floor_s": floor, "roofline_fraction": floor / t}


def decode_frame(paths: list[str]) -> tuple[pd.DataFrame, dict]:
    rows, meta = [], None
    for p in paths:
        run = read_json(p)
        meta = meta or run
        rows += [{**_with_rates(r, run), "device": run["device"]} for r in run["rows"]]
    if not rows:
        raise ValueError(f"no decode rows in {paths}")
    order = list(dict.fromkeys(r["variant"] for r in rows))    # the config's variant order
    frame = pd.DataFrame(rows).reindex(columns=COLUMNS)
    frame["variant"] = pd.Categorical(frame["variant"], categories=order, ordered=True)
    return frame.sort_values(["variant", "context"]).reset_index(drop=True), meta


def _pivot(ok, values, fmt, index=("variant",)):
    table = ok.pivot_table(index=list(index), columns="context", values=values, aggfunc="first",
                           observed=True)
    if len(index) > 1:   # one readable row label: "variant (vs baseline)"
        table.index = [f"{v} (vs {b})" for v, b in table.index]
        table.index.name = "variant"
    return table.to_markdown(floatfmt=fmt)


def decode_markdown(frame: pd.DataFrame, meta: dict) -> str:
    ok = frame[frame["error"].isna()].copy()
    ok["ms"] = ok["seconds_per_token"] * 1e3
    ok["GiB"] = ok["peak_bytes"] / 2 ** 30
    ok["roofline %"] = ok["roofline_fraction"] * 100
    cfg, ceil = meta["config"], meta["ceilings"]
    fails = frame[frame["error"].notna()][["variant", "context", "error"]]
    return (
        "# End-to-end decode: time per generated token and peak GPU memory vs context\n\n"
        f"{meta['device']}, Llama-2-7B shapes ({cfg['shape']['layers']} layers, hidden "
        f"{cfg['shape']['hidden']}, {cfg['shape']['heads']} heads), batch {cfg['batch']}; weights: "
        f"**{meta['weights']}**. Each step (embedding, every layer with its cache write, attention "
        "and MLP, LM head, argmax fed back) is one CUDA-graph replay; median of "
        f"{cfg['iters']} replays. "
        + ("Residual add + RMSNorm and SiLU·up run as one Triton launch each (`fused_ops`, "
           "kernels/fused_ops.py) in the dense and the Palu models alike. " if cfg.get("fused_ops") else "")
        + "Palu-50%: uniform ranks (half of each group's K and V); "
        "`-norope` rows are the same shapes without rotary embeddings (an OPT-like model), compared "
        "with the dense model of the same kind. Roofline floor: max((weights + cache bytes) / "
        f"measured copy bandwidth ({ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s), FLOPs / measured "
        f"fp16 matmul rate ({ceil['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s)); bytes, FLOPs, TB/s "
        "and TFLOP/s of every row are in decode.csv.\n\n"
        f"## ms per token\n\n{_pivot(ok, 'ms', '.2f')}\n\n"
        "## Speed-up over the row's baseline (dense fp16 model)\n\n"
        f"{_pivot(ok, 'speedup', '.2f', ('variant', 'baseline'))}\n\n"
        f"## Peak GPU memory (GiB, weights included)\n\n{_pivot(ok, 'GiB', '.1f')}\n\n"
        + ("" if "resident_before_bytes" in meta["rows"][0] else
           "Caveat: this run predates the per-variant accounting of memory still allocated by "
           "earlier variants. Peak minus (weights + cache) is 0.09-0.25 GiB for the first variant "
           "(fp16: workspace) and grows by ~0.2 GiB per variant in run order up to ~1.05 GiB, so "
           "the peaks of later variants are upper bounds, by up to ~0.8 GiB (decode.csv has "
           "weight_bytes and cache_bytes for each row).\n\n")
        + f"## Fraction of the roofline floor (%)\n\n{_pivot(ok, 'roofline %', '.0f')}\n\n"
        "## Correctness on this GPU (full-rank Palu vs dense, small shape, rel. error of logits)\n\n"
        + (pd.DataFrame(meta["checks"]).to_markdown(index=False, floatfmt=".2e") if meta["checks"] else "none")
        + f"\n\n## Points that did not run\n\n{fails.to_markdown(index=False) if len(fails) else 'none'}\n"
        + (hf_markdown(meta["hf"]) if meta.get("hf") else ""))


def hf_markdown(hf: dict) -> str:
    """The transformers-path section (`palu_bench.decode_transformers`): eager steps, and CUDA-graph replays
    (`graph` rows) where the run has them."""
    frame = pd.DataFrame(hf["rows"])
    if "error" not in frame:
        frame["error"] = None
    for column, default in (("graph", False), ("baseline", hf["baseline"])):
        # result files without graph rows: eager only, one baseline
        frame[column] = frame[column].fillna(default) if column in frame else default
    order = list(dict.fromkeys(frame["variant"]))
    frame["variant"] = pd.Categorical(frame["variant"], categories=order, ordered=True)
    ok = frame[frame["error"].isna()].copy()
    ok["ms"] = ok["seconds_per_token"] * 1e3
    ok["min ms"] = ok["seconds_min"] * 1e3
    ok["GiB"] = ok["cache_bytes"] / 2 ** 30
    fails = frame[frame["error"].notna()][["variant", "context", "error"]]
    checks = pd.DataFrame(hf["checks"])
    graphs = bool(frame["graph"].astype(bool).any())
    return (
        "\n## The transformers path"
        + (" (eager, and replayed as CUDA graphs)" if graphs else " (eager, no CUDA graph)")
        + "\n\n`LlamaForCausalLM` of the same shapes (random fp16 weights; Palu: `install_palu` with random "
        "factors of the same ranks), one `model(input_ids, past_key_values=cache)` call per token as "
        "`generate` makes it; Palu reads `palu.LatentCache` through the same kernels (fused o_proj "
        "of the latent outputs). Dense: transformers' `StaticCache` (the baseline) and `DynamicCache` "
        "(generate's default; it concatenates, copying the cache every step). These eager steps are "
        "bound by Python and launch overhead (compare the CUDA-graph table above): what the HF "
        "integration delivers as is, not what the kernels can. Being host-bound they vary with "
        "the host's load from run to run (by up to ~1.5x on the shared H200 host), more than the "
        "graph-replayed steps; hence the fastest step beside the median.\n\n"
        + ("`-graph` rows replay each step of the same model as one CUDA graph: Palu through "
           "`palu.GraphLatentCache` (preallocated slots written in place at device-side positions) "
           "and `palu.GraphDecoder` (one graph per bucket of context lengths, at most 1/8 more slots "
           "than tokens, masked by length on the device), dense through transformers' "
           "`StaticCache` captured the same way (it attends over all its slots, sized here to the "
           "context plus the timed steps). Their speed-ups are over the dense graph row.\n\n"
           if graphs else "")
        + f"### ms per token (median)\n\n{_pivot(ok, 'ms', '.2f')}\n\n"
        f"### ms per token (fastest step)\n\n{_pivot(ok, 'min ms', '.2f')}\n\n"
        f"### Speed-up over the row's baseline (medians)\n\n"
        f"{_pivot(ok, 'speedup', '.2f', ('variant', 'baseline'))}\n\n"
        f"### Cache (GiB, buffers held)\n\n{_pivot(ok, 'GiB', '.2f')}\n\n"
        "### Kernels vs torch path (one step, same cache contents; rel. error of the logits)\n\n"
        + (checks.to_markdown(index=False, floatfmt=".2e") if len(checks) else "none")
        + f"\n\n### Points that did not run\n\n{fails.to_markdown(index=False) if len(fails) else 'none'}\n")


def memory_figure(frame: pd.DataFrame, out: str | Path) -> None:
    """Peak memory (left) and time per token (right) against context. A colour is one cache format
    (dense fp16, or Palu at a group size and latent width), in both panels; the line style says
    RoPE (solid) or not (dashed). Memory does not depend on RoPE, so the left panel draws each
    format once (the RoPE variant where it ran)."""
    from matplotlib.lines import Line2D
    ok = frame[frame["error"].isna()].copy()
    ok["format"] = ok["variant"].astype(str).str.replace("-norope", "", regex=False)
    formats = list(dict.fromkeys(ok["format"]))
    colour = {f: plt.get_cmap("tab10")(i % 10) for i, f in enumerate(formats)}
    fig, (mem, lat) = plt.subplots(1, 2, figsize=(13, 4.8))
    for fmt in formats:
        grp = ok[ok["format"] == fmt]
        one = grp[grp["rope"].astype(bool)] if grp["rope"].astype(bool).any() else grp
        one = one[one["variant"] == one["variant"].iloc[0]].sort_values("context")
        mem.plot(one["context"], one["peak_bytes"] / 2 ** 30, marker="o", color=colour[fmt], label=fmt)
        for variant, v in grp.groupby("variant", observed=True):
            v = v.sort_values("context")
            lat.plot(v["context"], v["seconds_per_token"] * 1e3, marker="o", color=colour[fmt],
                     ls="-" if bool(v["rope"].iloc[0]) else "--")
    for ax, label in ((mem, "peak GPU memory (GiB, weights included)"), (lat, "ms per generated token")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    mem.set_title("Llama-2-7B shapes, batch 1: peak memory (the same with or without RoPE)", fontsize=10)
    lat.set_title("decode latency (CUDA graph)", fontsize=10)
    mem.legend(fontsize=7, title="cache format", title_fontsize=7)
    mem.text(0.98, 0.02, "one latent width stores the same bytes at any group size\n(those lines overlap)",
             transform=mem.transAxes, ha="right", va="bottom", fontsize=7, color="0.35")
    lat.legend(handles=[Line2D([], [], color=colour[f], marker="o", label=f) for f in formats]
               + [Line2D([], [], color="black", ls="-", label="RoPE"),
                  Line2D([], [], color="black", ls="--", label="no RoPE")], fontsize=7, ncol=2)
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, dpi=130, format="png")
    plt.close(fig)
