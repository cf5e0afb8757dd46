"""Native W&B plots of the key comparisons, built from a collected table's frame.

A synced project then shows the paper's curves without opening the repository: perplexity vs
kept ratio per granularity, perplexity vs effective bits per method family, attention latency
and decode time vs context. Each plot is keyed `<table>/<what>` (one per corpus where the table
has corpora).
"""
from __future__ import annotations

import math

import pandas as pd


def _series(frame: pd.DataFrame, x: str, y: str, by: str):
    """xs and ys per value of `by`, sorted by x, NaNs left out (W&B plots reject them)."""
    xs, ys, keys = [], [], []
    for key, part in frame.groupby(by, sort=True):
        part = part[[x, y]].dropna().sort_values(x)
        part = part[part[y].map(lambda v: math.isfinite(float(v)))]
        if len(part):
            xs.append(part[x].astype(float).tolist())
            ys.append(part[y].astype(float).tolist())
            keys.append(str(key))
    return xs, ys, keys


def _line(frame, x, y, by, title, xname):
    import wandb
    xs, ys, keys = _series(frame, x, y, by)
    return wandb.plot.line_series(xs=xs, ys=ys, keys=keys, title=title, xname=xname) if keys else None


def _per_corpus(frame, make):
    plots = {}
    for corpus, part in frame.groupby("corpus", sort=True):
        plot = make(part, corpus)
        if plot is not None:
            plots[corpus] = plot
    return plots


def granularity(frame):
    rows = frame[frame["granularity"] != "-"]
    return {f"ppl_vs_kept_ratio/{c}": p for c, p in _per_corpus(rows, lambda part, c: _line(
        part, "kept_ratio_realised", "ppl", "granularity",
        f"Perplexity vs kept ratio ({c})", "kept ratio")).items()}


def by_bytes(frame):
    import wandb

    def scatter(part, corpus):
        cols = ["method", "family", "effective_bits", "ppl"]
        table = wandb.Table(dataframe=part[cols].dropna().reset_index(drop=True))
        return wandb.plot.scatter(table, "effective_bits", "ppl",
                                  title=f"Perplexity vs effective bits per value ({corpus})")
    return {f"ppl_vs_bits/{c}": p for c, p in _per_corpus(frame, scatter).items()} | {
        f"ppl_vs_bits_by_family/{c}": p for c, p in _per_corpus(frame, lambda part, c: _line(
            part, "effective_bits", "ppl", "family",
            f"Perplexity vs effective bits, per family ({c})", "effective bits")).items()}


def latency(frame):
    rows = frame[frame["speedup"].notna()].copy()
    rows["series"] = rows["variant"].astype(str) + rows["bits"].map(
        lambda b: "" if pd.isna(b) else f"-b{int(b)}")
    plots = {}
    for shape, part in rows.groupby("shape", sort=True):
        plot = _line(part, "length", "speedup", "series",
                     f"Decode attention speed-up over SDPA vs context ({shape})", "tokens")
        if plot is not None:
            plots[f"speedup_vs_context/{shape}"] = plot
    return plots


def decode(frame):
    rows = frame.copy()
    rows["series"] = rows["variant"].astype(str)
    plot = _line(rows, "context", "seconds_per_token", "series",
                 "Decode time per token vs context", "tokens")
    return {"seconds_per_token_vs_context": plot} if plot is not None else {}


PLOTS = {"granularity": granularity, "quantization": by_bytes, "latency": latency,
         "decode": decode}


def native_plots(table: str, frame: pd.DataFrame) -> dict:
    """The W&B plots for a collected table (none for tables without a key comparison)."""
    make = PLOTS.get(table)
    return {f"{table}/{key}": plot for key, plot in make(frame).items()} if make else {}
