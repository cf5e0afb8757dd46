"""Artifact paths named by their parameters: a path says what it holds (one source for CLI and DAG)."""
from __future__ import annotations

from pathlib import Path

from ..decompose.checkpoint import checkpoint_tag
from ..methods.palu import bits_tag


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


def palu_tag(decomposition: str, rank_method: str, kept_ratio: float | str, group_size: int | str,
             bits: int | str = 16) -> str:
    """A Palu run's method tag: its checkpoint's tag (the library's) plus the latent bit width."""
    return checkpoint_tag(decomposition, rank_method, kept_ratio, group_size) + bits_tag(bits)


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


# ---- the same names from a validated step config (what the entry points call) ------------------
def calibration_tag_of(cfg) -> str:
    c = cfg.calibration
    return calibration_tag(c.corpus, c.samples, c.seqlen, c.seed)


def fisher_tag_of(cfg) -> str:
    f = cfg.fisher
    return fisher_tag(f.samples, f.seqlen, f.seed)


def gram_path_of(cfg) -> Path:
    return gram_path(cfg.paths.work, cfg.model.name, calibration_tag_of(cfg))


def fisher_path_of(cfg) -> Path:
    return fisher_path(cfg.paths.work, cfg.model.name, calibration_tag_of(cfg), fisher_tag_of(cfg))


def ranks_path_of(cfg) -> Path:
    p = cfg.palu
    return ranks_path(cfg.paths.work, cfg.model.name, calibration_tag_of(cfg), fisher_tag_of(cfg),
                      p.rank_method, p.kept_ratio, p.group_size, p.rank_multiple)


def checkpoint_dir_of(cfg) -> Path:
    p = cfg.palu
    tag = checkpoint_tag(p.decomposition, p.rank_method, p.kept_ratio, p.group_size)
    return checkpoint_dir(cfg.paths.work, cfg.model.name, calibration_tag_of(cfg),
                          fisher_tag_of(cfg), tag, p.rank_multiple, p.rank_method)


def log_path(work: str, step: str, name: str) -> Path:
    """A rule's log file (Snakemake `log:`)."""
    return Path(work) / "logs" / step / f"{name}.log"


def benchmark_path(work: str, step: str, name: str) -> Path:
    """A rule's timing file (Snakemake `benchmark:`)."""
    return Path(work) / "benchmarks" / step / f"{name}.tsv"


def table_prefix(results: str, table: str) -> Path:
    """results/tables/<table>: the collect step writes <prefix>.csv and <prefix>.md."""
    return Path(results) / "tables" / table


def figure_path(results: str, name: str) -> Path:
    return Path(results) / "figures" / f"{name}.png"


def gpu_results_dir(results: str, bench: str) -> Path:
    """results/<bench>/: the committed GPU benchmark JSON (`latency`, `decode`)."""
    return Path(results) / bench
