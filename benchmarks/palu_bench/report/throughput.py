"""results/tables/throughput.{csv,md} and results/figures/throughput.png: prompts per second of
the suites' answering path by method and batch size, beside transformers' own `generate`, and
the largest batch each method's KV cache fits in a fixed memory budget (palu_bench.batch_throughput
JSON in results/throughput/)."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from palu.artifacts import atomic_path, read_json  # noqa: E402

COLUMNS = ["run", "path", "method", "batch", "prompts", "prompts_per_s", "seconds", "peak_gib",
           "kv_mib_per_prompt", "differ", "compared", "budget_gib", "fits", "kv_gib", "oom", "switches"]


def throughput_frame(inputs: list[str]) -> tuple[pd.DataFrame, dict]:
    """One row per measurement of every input file (`run` names the file); the configs by run."""
    rows, meta = [], {}
    for path in inputs:
        data = read_json(path)
        run = path.rsplit("/", 1)[-1].removesuffix(".json")
        meta[run] = {**data["config"], **data["env"], "skipped": data.get("skipped", []),
                     "notes": data.get("notes", []), "weights": data.get("weights", "real")}
        for r in data["rows"]:
            agree = r.get("agreement") or {}
            kv = r.get("kv_bytes_per_prompt")
            rows.append({"run": run, **{k: r.get(k) for k in COLUMNS if k in r},
                         "kv_mib_per_prompt": None if kv is None else kv / 2**20,
                         "differ": agree.get("differ"), "compared": agree.get("prompts"),
                         "oom": bool(r.get("oom", False)),
                         # the decode path it was timed on (a right-padded prefill, say)
                         "switches": " ".join(f"{k}={v}" for k, v in sorted((r.get("switches") or {}).items()))})
    if not rows:
        raise ValueError(f"no throughput rows in {inputs}")
    return pd.DataFrame(rows).reindex(columns=COLUMNS), meta


def _fmt(x, spec=".2f"):
    return "—" if x is None or pd.isna(x) else format(x, spec)


def throughput_markdown(frame: pd.DataFrame, meta: dict) -> str:
    lines = ["# Batched evaluation throughput (issue 49)", ""]
    for run, cfg in meta.items():
        random = cfg["weights"] == "random"
        lines.append(f"- `{run}`: " + (f"**random weights** of `{cfg['model']}`'s shapes (random prompts: "
                                       "times and memory hold, answers and the tokens a method keeps are "
                                       "not the model's); " if random else "") + f"{cfg.get('gpu', 'cpu')}"
                     + (f" ({cfg['started_utc']})" if cfg.get("started_utc") else "") + f", torch {cfg['torch']}, transformers "
                     f"{cfg['transformers']}; prompts of {cfg['length'] - cfg['length'] // 8}-{cfg['length']} "
                     f"tokens (left-padded batches) + {cfg['new_tokens']} generated greedily, EOS off; "
                     f"{cfg['dtype']}; " + ({"full": "each shape and answer length warmed up untimed first"}.get(
                         cfg.get("warmup"), "each shape warmed up untimed first (2 tokens: what an answer first met later may have compiled inside the timing)")
                         if cfg.get("warmup") else "**no warm-up**: the first call of each shape is timed")
                     + (f"; not measured (time limit): {', '.join(cfg['skipped'])}"
                                          if cfg["skipped"] else ""))
        lines += [f"  - {note}" for note in cfg.get("notes", [])]   # what a row measured that the code no longer does
    speed = frame[frame.path != "budget"]
    lines += ["", "## Prompts per second by batch size", "",
              "`palu`: `palu.eval.generation.answer_batches` (every long-context suite's path), "
              "`transformers-*`: `generate` with its own cache. Batch 1 is timed over several prompts "
              "one at a time; each larger size over one batch. A row is `out of memory` where "
              "the batch did not fit.", "",
              "| run | path | method | batch | prompts/s | peak GiB | KV MiB / prompt | answers differing from batch 1 | decode switches |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in speed.itertuples():
        differ = "—" if pd.isna(r.differ) else f"{int(r.differ)} of {int(r.compared)}"
        lines.append(f"| {r.run} | {r.path} | {r.method} | {int(r.batch)} | "
                     f"{'out of memory' if r.oom else _fmt(r.prompts_per_s)} | {_fmt(r.peak_gib, '.1f')} | "
                     f"{_fmt(r.kv_mib_per_prompt, '.1f')} | {differ} | {r.switches or '—'} |")
    budget = frame[frame.path == "budget"]
    if len(budget):
        lines += ["", "## At a fixed KV-cache budget", "",
                  "The largest batch whose cache (bytes as stored, measured per prompt) fits the budget, "
                  "run as one batch.", "",
                  "| run | method | budget GiB | batch | KV GiB held | prompts/s | peak GiB |",
                  "|---|---|---|---|---|---|---|"]
        for r in budget.itertuples():
            lines.append(f"| {r.run} | {r.method} | {_fmt(r.budget_gib, 'g')} | {int(r.batch)} | "
                         f"{_fmt(r.kv_gib)} | {'out of memory' if r.oom else _fmt(r.prompts_per_s)} | "
                         f"{_fmt(r.peak_gib, '.1f')} |")
    return "\n".join(lines) + "\n"


def throughput_figure(frame: pd.DataFrame, path: str, meta: dict | None = None) -> None:
    """Prompts/s against batch size, one line per (path, method), a panel per run."""
    meta_weights = {run: cfg.get("weights") for run, cfg in (meta or {}).items()}
    runs = list(dict.fromkeys(frame.run))
    cols = min(3, len(runs))           # a row of many panels shrinks each past reading
    rows = -(-len(runs) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.5 * rows), squeeze=False)
    for ax in axes.flat[len(runs):]:
        ax.set_visible(False)
    for ax, run in zip(axes.flat, runs):
        part = frame[(frame.run == run) & (frame.path != "budget") & ~frame.oom]
        # a run of more than the 10 default colours repeated them (FP16 and TurboQuant alike in
        # session 46's panel): 20 colours, and a marker per ten lines
        colours = plt.get_cmap("tab20").colors
        for i, ((path_, method), g) in enumerate(part.groupby(["path", "method"], sort=False)):
            g = g.sort_values("batch")
            style = "--" if path_.startswith("transformers") else "-"
            label = method if path_ == "palu" else f"{path_} ({method})"
            ax.plot(g.batch, g.prompts_per_s, style, marker="osD^v"[(i // 10) % 5], color=colours[i % 20],
                    label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size (prompts)")
        ax.set_ylabel("prompts / s")
        ax.set_title(run + (" (random weights)" if meta_weights.get(run) == "random" else ""), fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
