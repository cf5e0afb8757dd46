"""Tables from per-run metrics JSON: one row per run, columns that say exactly what was run."""
from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from palu.eval.stats import ppl_difference, ppl_interval
from palu.artifacts import read_json
from palu.methods import family_of
from palu.pipeline.reporting import write_frame

COLUMNS = ["model", "method", "corpus", "corpus_label", "seqlen", "tokens", "kept_ratio_target",
           "kept_ratio_realised", "group_size", "granularity", "rank_method", "decomposition",
           "rotation", "recovery", "calibration_samples", "calibration_seqlen", "fisher_samples", "family",
           "kv_bits", "effective_bits", "compression_vs_fp16", "cache_bytes_fp16", "dtype", "ppl",
           "ppl_lo", "ppl_hi", "diff_vs_fp16", "diff_lo", "diff_hi", "significant"]
BYTES = ("effective_bits", "compression_vs_fp16", "cache_bytes_fp16")


def granularity_name(group_size, num_kv_heads) -> str:
    if group_size is None:
        return "-"
    if group_size == 1:
        return "M-LRD"
    return "J-LRD" if group_size == num_kv_heads else f"G-LRD(s={group_size})"


def run_row(path: str | Path) -> dict:
    """One table row from a run file: its metrics, which carry the method's `summary()` (a
    column the method does not report takes the unmodified model's value)."""
    m = read_json(path)["metrics"]
    if not isinstance(m.get("ppl"), (int, float)) or not math.isfinite(m["ppl"]):
        raise ValueError(f"{path}: ppl {m.get('ppl')!r} is not a finite number")
    return {
        "model": m["model"], "method": m["method"], "corpus": m["corpus"],
        "corpus_label": m["corpus_label"], "seqlen": m["seqlen"], "tokens": m["tokens"],
        "kept_ratio_target": m.get("kept_ratio_target", 1.0),
        "kept_ratio_realised": m.get("kept_ratio_realised", 1.0),
        "group_size": m.get("group_size"),
        "granularity": granularity_name(m.get("group_size"), m.get("num_kv_heads")),
        "rank_method": m.get("rank_method", "-"), "decomposition": m.get("decomposition", "-"),
        "rotation": m.get("rotation", "none"), "recovery": m.get("recovery", "-"),
        "calibration_samples": m.get("calibration_samples", 0),
        "calibration_seqlen": m.get("calibration_seqlen", 0),
        "fisher_samples": m.get("fisher_samples", 0),
        "family": family_of(m),
        "kv_bits": m.get("kv_bits", 16),
        "byte_ratio_target": m.get("byte_ratio_target", math.nan),
        # measured from a real cache at the evaluated length (older result files have none)
        **{k: m.get(k, math.nan) for k in BYTES},
        "dtype": m.get("dtype"), "ppl": m["ppl"],
        # 95% interval over the run's token blocks (older result files stored none)
        **dict(zip(("ppl_lo", "ppl_hi"), ppl_interval(m["block_nll"], m["block_tokens"])
                   if m.get("block_nll") else (math.nan, math.nan))),
    }


def _blocks(path: str | Path):
    m = read_json(path)["metrics"]
    return (m.get("block_nll"), m.get("block_tokens"))


def _write_pairs(frame: pd.DataFrame, blocks: list, pairs, columns: list[str]) -> list:
    """For each (row, reference row): row's ppl minus the reference's on the same token blocks
    (95% paired bootstrap) into `columns` = [diff, lo, hi, significant]; a pair whose blocks are
    missing or differ (other windows) is left NaN. Returns the pairs written."""
    written = []
    for i, j in pairs:
        (nll, tok), (ref_nll, ref_tok) = blocks[i], blocks[j]
        if nll is None or ref_nll is None or tok != ref_tok:
            continue
        d = ppl_difference(nll, ref_nll, tok)
        frame.loc[i, columns[:3]] = d["diff"], d["lo"], d["hi"]
        frame.at[i, columns[3]] = d["significant"]
        written.append((i, j))
    return written


def add_paired_differences(frame: pd.DataFrame, blocks: list) -> pd.DataFrame:
    """Each run's ppl minus FP16's on the same corpus and token blocks (`blocks`: each row's
    `_blocks`), with a 95% paired interval; NaN where either run lacks blocks or their blocks
    differ (other windows)."""
    frame = frame.assign(diff_vs_fp16=math.nan, diff_lo=math.nan, diff_hi=math.nan, significant=None)
    pairs = []
    for corpus in frame["corpus"].unique():
        ref = frame.index[(frame["corpus"] == corpus) & (frame["method"] == "fp16")]
        if len(ref):
            pairs += [(i, ref[0]) for i in frame.index[(frame["corpus"] == corpus) & (frame["method"] != "fp16")]]
    _write_pairs(frame, blocks, pairs, ["diff_vs_fp16", "diff_lo", "diff_hi", "significant"])
    return frame


_SAME_CHECKPOINT_AND_BITS = ["corpus", "kept_ratio_target", "group_size", "rank_method", "decomposition", "kv_bits"]
# Tables that compare variants of one setting pair each row with its reference variant:
# table -> (column, the reference's value, the columns a row shares with its reference)
REFERENCES = {
    "rank_allocation": ("rank_method", "uniform", ["corpus", "kept_ratio_target", "group_size", "decomposition", "kv_bits"]),
    "factors": ("decomposition", "whitened", ["corpus", "kept_ratio_target", "group_size", "rank_method"]),
    "recovery": ("recovery", "-", ["corpus", "kept_ratio_target", "group_size", "rank_method",
                                   "decomposition"]),
    # a (rank, bits) allocation against the uniform checkpoint whose latent bytes are its budget
    "byte_budget": ("rank_method", "uniform", ["corpus", "group_size", "byte_ratio_target"]),
    # each latent width against the same checkpoint's unquantised latents
    "latent_bits": ("kv_bits", 16, ["corpus", "kept_ratio_target", "group_size", "rank_method",
                                    "decomposition", "rotation"]),
    # a rotated checkpoint against the unrotated one at the same latent width
    "hadamard": ("rotation", "none", _SAME_CHECKPOINT_AND_BITS),
    "quantization": ("rotation", "none", _SAME_CHECKPOINT_AND_BITS),
}
# what a table's pairs share, where it is not "corpus, kept ratio and granularity"
PAIRING = {"byte_budget": "same corpus, granularity and latent bytes",
           "latent_bits": "same corpus and checkpoint, its latents unquantised",
           "hadamard": "same corpus, checkpoint settings and latent bits, no rotation",
           "quantization": "Palu rows with a rotation: the same checkpoint settings and latent bits, no rotation"}
# columns a table shows beyond COLUMNS (its pairing reads them)
EXTRA_COLUMNS = {"byte_budget": ["byte_ratio_target"]}
# ... and some against a second reference: rank_allocation's own allocators against the paper's
SECOND_REFERENCES = {
    "rank_allocation": ("rank_method", "fisher", ["corpus", "kept_ratio_target", "group_size", "decomposition", "kv_bits"],
                        ["uniform"]),
}
# ... and the searching allocator against the choice it starts from (issue 53): does the search
# add anything to probe_select? (columns only where a table has search rows)
START_REFERENCES = {
    "rank_allocation": ("rank_method", "probe_select", ["corpus", "kept_ratio_target", "group_size", "decomposition", "kv_bits"],
                        "search"),
}
REF_COLUMNS = ["reference", "diff_vs_ref", "ref_lo", "ref_hi", "ref_significant"]
REF2_COLUMNS = ["reference2", "diff_vs_ref2", "ref2_lo", "ref2_hi", "ref2_significant"]
REF3_COLUMNS = ["start", "diff_vs_start", "start_lo", "start_hi", "start_significant"]


def add_paired_vs_reference(frame: pd.DataFrame, blocks: list, column: str, value,
                            match: list[str], skip=(), columns=REF_COLUMNS) -> pd.DataFrame:
    """Each row's ppl minus its reference row's (the row with `column == value` and the same
    `match` columns) on the same token blocks, with a 95% paired interval, into `columns`;
    rows whose `column` is in `skip` are not paired."""
    name, diff, lo, hi, sig = columns
    frame = frame.assign(**{name: None, diff: math.nan, lo: math.nan, hi: math.nan, sig: None})
    refs = frame[frame[column] == value]
    pairs = []
    for i in frame.index[(frame[column] != value) & (frame["method"] != "fp16") & ~frame[column].isin(skip)]:
        same = refs[(refs[match] == frame.loc[i, match]).all(axis=1)]
        if len(same) == 1:
            pairs.append((i, same.index[0]))
    for i, j in _write_pairs(frame, blocks, pairs, [diff, lo, hi, sig]):
        frame.at[i, name] = frame.at[j, "method"]
    return frame


def build_table(paths: list[str], need_bytes: bool = False, table: str | None = None) -> pd.DataFrame:
    """One row per run file; `need_bytes`: every run must carry its measured cache bytes (a
    table that compares methods at bytes refuses a run without them); a `table` of REFERENCES
    also pairs each row with its reference variant."""
    if not paths:
        raise ValueError("no run files given to build a table from")
    rows = [run_row(p) for p in paths]
    if need_bytes:
        missing = [str(p) for p, r in zip(paths, rows) if not math.isfinite(r["effective_bits"])]
        if missing:
            raise ValueError(f"runs without measured cache bytes (evaluate them again): {missing}")
    columns = COLUMNS[:-4] + EXTRA_COLUMNS.get(table, [])
    blocks = [_blocks(p) for p in paths]     # read once, paired against every reference
    frame = add_paired_differences(pd.DataFrame(rows, columns=columns), blocks)
    if table in REFERENCES:
        frame = add_paired_vs_reference(frame, blocks, *REFERENCES[table])
    if table in SECOND_REFERENCES:
        column, value, match, skip = SECOND_REFERENCES[table]
        frame = add_paired_vs_reference(frame, blocks, column, value, match, skip, REF2_COLUMNS)
    if table in START_REFERENCES:
        column, value, match, only = START_REFERENCES[table]
        # the allocator and its variants (`search-e800`: another search budget)
        others = [v for v in frame[column].unique() if not (v == only or str(v).startswith(f"{only}-"))]
        frame = add_paired_vs_reference(frame, blocks, column, value, match, others, REF3_COLUMNS)
        if frame[REF3_COLUMNS[1]].isna().all():   # no search rows: the table as before
            frame = frame.drop(columns=REF3_COLUMNS)
    key = ["model", "method", "corpus", "seqlen", "tokens", "dtype"]
    twice = frame[frame.duplicated(key, keep=False)]
    if len(twice):   # two settings under one label: a table would silently show one of them
        raise ValueError(f"runs with the same {key} in one table: {sorted(set(map(str, paths)))}")
    frame = frame.sort_values(["corpus", "method", "kept_ratio_target", "group_size"],
                             ascending=[True, True, False, True], na_position="first",
                             kind="stable").reset_index(drop=True)
    frame.attrs["pairing"] = PAIRING.get(table, "same corpus, kept ratio and granularity")
    palu = frame[frame["method"] != "fp16"]
    if table == "rank_allocation" and (palu["decomposition"].nunique() > 1 or palu["kv_bits"].nunique() > 1):
        # the composition rows (issue 53): a row pairs with the same factors and latent width
        frame.attrs["pairing"] = "same corpus, kept ratio, granularity, factor objective and latent width"
    return frame


def to_markdown(frame: pd.DataFrame, title: str) -> str:
    shown = frame.drop(columns=["corpus"]).copy()
    if shown["effective_bits"].isna().all():   # tables of runs without measured bytes
        shown = shown.drop(columns=list(BYTES))
    shown["ppl"] = shown["ppl"].map(lambda v: f"{v:.3f}")
    intervals = frame["ppl_lo"].notna().any()
    if not intervals:
        shown = shown.drop(columns=["ppl_lo", "ppl_hi", "diff_vs_fp16", "diff_lo", "diff_hi", "significant"])
    paired = _paired_section(frame, REF_COLUMNS, "the reference variant") + \
        _paired_section(frame, REF2_COLUMNS, "the second reference") + \
        _paired_section(frame, REF3_COLUMNS, "the search's start")
    shown = shown.drop(columns=[c for c in REF_COLUMNS + REF2_COLUMNS + REF3_COLUMNS if c in shown])
    shown["kept_ratio_realised"] = shown["kept_ratio_realised"].map(lambda v: f"{v:.4f}")
    cells = frame.assign(cell=[_cell(r) for _, r in frame.iterrows()]) if intervals else frame
    pivot = cells.pivot_table(index=["method"], columns="corpus", values="cell" if intervals else "ppl",
                              aggfunc="first")
    if frame["effective_bits"].notna().any():
        sizes = frame.groupby("method")[["effective_bits", "compression_vs_fp16"]].first()
        pivot = pivot.join(sizes.rename(columns={"effective_bits": "bits/element",
                                                 "compression_vs_fp16": "x vs FP16"}))
    pivot = pivot.reindex(row_order(frame))
    note = ("Cells: ppl [95% interval over the run's 128-token blocks] and, for a compressed row, its "
            "paired difference to FP16 on the same blocks with its 95% paired bootstrap interval (\"~\": "
            "the interval contains 0, not a change). " if intervals else "")
    return (f"# {title}\n\nPerplexity (lower is better); every number was produced by the pipeline "
            f"from the run files in results/runs/. {note}Corpora marked as stand-ins are embedded "
            f"substitutes, not the paper's corpora.\n\n"
            f"{pivot.to_markdown(floatfmt='.3f')}\n\n{paired}## All columns\n\n"
            f"{shown.to_markdown(index=False)}\n")


def _paired_section(frame: pd.DataFrame, columns: list[str], what: str) -> str:
    """Each row against its reference variant (REFERENCES, SECOND_REFERENCES, START_REFERENCES):
    better / worse only where the 95% paired interval excludes 0."""
    name, diff, lo, hi, sig = columns
    if diff not in frame or frame[diff].isna().all():
        return ""
    rows = []
    for _, r in frame[frame[diff].notna()].iterrows():
        verdict = "~ (tie)" if not r[sig] else ("better" if r[diff] < 0 else "worse")
        rows.append({"method": r["method"], "corpus": r["corpus"], "reference": r[name],
                     "Δ ppl": f"{r[diff]:+.2f} [{r[lo]:+.2f}, {r[hi]:+.2f}]", "verdict": verdict})
    pairing = frame.attrs.get("pairing", "same corpus, kept ratio and granularity")
    return (f"## Paired against {what}\n\nEach row minus its reference ({pairing}) "
            "on the same token blocks, 95% paired bootstrap interval; "
            "\"better\" / \"worse\" only where the interval excludes 0.\n\n"
            f"{pd.DataFrame(rows).to_markdown(index=False)}\n\n")


def _cell(r) -> str:
    if math.isnan(r["ppl_lo"]):
        return f"{r['ppl']:.3f}"
    text = f"{r['ppl']:.2f} [{r['ppl_lo']:.2f}, {r['ppl_hi']:.2f}]"
    if not math.isnan(r["diff_vs_fp16"]):
        text += (f" Δ{r['diff_vs_fp16']:+.2f} [{r['diff_lo']:+.2f}, {r['diff_hi']:+.2f}]"
                 + ("" if r["significant"] else " ~"))
    return text


def row_order(frame: pd.DataFrame) -> list[str]:
    """Methods in reading order: FP16, then by family, kept ratio (high first), group size,
    allocator, objective, rotation (none first), recovery, bits per element (high first)."""
    keyed = frame.assign(_fp16=frame["method"] != "fp16", _kept=-frame["kept_ratio_target"].fillna(2),
                         _bits=-frame["effective_bits"].fillna(16),
                         _rotation=frame["rotation"].fillna("").replace("none", ""))
    keys = ["_fp16", "family", "_kept", "group_size", "rank_method", "decomposition", "_rotation",
            "recovery", "_bits", "method"]
    keyed = keyed.sort_values([k for k in keys if k in keyed], na_position="first", kind="stable")
    return list(dict.fromkeys(keyed["method"]))


def write_table(frame: pd.DataFrame, prefix: str | Path, title: str) -> None:
    write_frame(frame, prefix, to_markdown(frame, title))
