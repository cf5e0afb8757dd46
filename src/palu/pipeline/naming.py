"""Artifact paths named by their parameters: a path says what it holds (one source for CLI and DAG)."""
from __future__ import annotations

from pathlib import Path


def fmt_ratio(x: float | str) -> str:
    # Strings pass through so the Snakefile can build wildcard patterns with the same functions.
    return x if isinstance(x, str) else f"{float(x):g}"


def tokens_tag(max_tokens: int | str | None) -> str:
    if isinstance(max_tokens, str):
        return max_tokens
    return "all" if max_tokens in (None, 0) else str(int(max_tokens))


def prepared_model_dir(work: str, model: str) -> Path:
    return Path(work) / "models" / model


def model_source(work: str, model: str, model_id: str) -> str:
    """The prepared (fast-loading) copy of a model if the pipeline made one, else its id."""
    prepared = prepared_model_dir(work, model)
    return str(prepared) if (prepared / "config.json").is_file() else model_id


def calibration_tag(corpus: str, samples: int, seqlen: int, seed: int) -> str:
    return f"{corpus}-n{samples}-L{seqlen}-s{seed}"


def fisher_tag(samples: int, seqlen: int, seed: int) -> str:
    return f"fisher-n{samples}-L{seqlen}-s{seed}"


def gram_path(work: str, model: str, ctag: str) -> Path:
    return Path(work) / "calib" / model / ctag / "gram.safetensors"


def fisher_path(work: str, model: str, ctag: str, ftag: str) -> Path:
    return Path(work) / "calib" / model / ctag / ftag / "fisher.safetensors"


def palu_tag(decomposition: str, rank_method: str, kept_ratio: float, group_size: int) -> str:
    return f"palu-{decomposition}-{rank_method}-k{fmt_ratio(kept_ratio)}-g{group_size}"


def ranks_path(work: str, model: str, ctag: str, ftag: str, rank_method: str, kept_ratio: float,
               group_size: int, multiple: int) -> Path:
    # Uniform ranks depend on neither calibration nor Fisher: one file serves every setting.
    stem = f"{rank_method}-k{fmt_ratio(kept_ratio)}-g{group_size}-m{multiple}.json"
    if rank_method == "uniform":
        return Path(work) / "ranks" / model / stem
    return Path(work) / "ranks" / model / ctag / ftag / stem


def checkpoint_dir(work: str, model: str, ctag: str, ftag: str, tag: str, multiple: int | str,
                   rank_method: str) -> Path:
    # Uniform ranks use no Fisher scores, so their checkpoints must not depend on the Fisher setting.
    ftag = "no-fisher" if rank_method == "uniform" else ftag
    return Path(work) / "palu" / model / ctag / ftag / f"{tag}-m{multiple}"


def metrics_path(results: str, model: str, method_tag: str, corpus: str, seqlen: int,
                 max_tokens: int | None) -> Path:
    return (Path(results) / "runs" / model / method_tag /
            f"ppl-{corpus}-L{seqlen}-T{tokens_tag(max_tokens)}.json")
