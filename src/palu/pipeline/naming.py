"""Artifact paths named by their parameters: a path says what it holds (one source for CLI and DAG)."""
from __future__ import annotations

import re

from pathlib import Path

from palu.decompose.checkpoint import checkpoint_tag, head_order_tag, rotation_tag
from palu.decompose.lineage import bos_tag, calibration_tag, fisher_tag
from palu.methods.palu import latent_bits_tag


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


def gram_path(work: str, model: str, ctag: str) -> Path:
    return Path(work) / "calib" / model / ctag / "gram.safetensors"


def fisher_path(work: str, model: str, ctag: str, ftag: str) -> Path:
    return Path(work) / "calib" / model / ctag / ftag / "fisher.safetensors"


def palu_tag(decomposition: str, rank_method: str, kept_ratio: float | str, group_size: int | str,
             latent_bits: int | str = 16, rotation: str = "", recovery: str = "") -> str:
    """A Palu run's method tag: its checkpoint's tag (the library's) plus the latent width
    (`rotation`: a `rotation_tag`, `recovery`: a `recovery_tag`, or wildcard patterns)."""
    return (checkpoint_tag(decomposition, rank_method, kept_ratio, group_size, rotation) + recovery
            + latent_bits_tag(latent_bits))


def recovery_tag(rank: int, steps: int, samples: int, seqlen: int, lr: float, init_scale: float,
                 seed: int) -> str:
    """What a LoRA-recovered checkpoint adds to its base's tag: every setting of its training."""
    return f"-lora{rank}-s{steps}-n{samples}x{seqlen}-lr{lr:g}-i{init_scale:g}-d{seed}"


def recovery_tag_of(cfg) -> str:
    r = cfg.recovery
    return recovery_tag(r.rank, r.steps, r.samples, r.seqlen, r.lr, r.init_scale, r.seed)


def ranks_root(work: str, model: str) -> Path:
    return Path(work) / "ranks" / model


def palu_root(work: str, model: str) -> Path:
    return Path(work) / "palu" / model


def ranks_path(work: str, model: str, ctag: str, ftag: str, rank_method: str, kept_ratio: float,
               group_size: int, multiple: int, head_order: str = "none") -> Path:
    # Uniform ranks depend on neither calibration nor Fisher (nor the head order): one file
    # serves every setting. Per-head statistics follow a similarity head order.
    order = "" if rank_method == "uniform" else head_order_tag(head_order)
    stem = f"{rank_method}-k{fmt_ratio(kept_ratio)}-g{group_size}{order}-m{multiple}.json"
    if rank_method == "uniform":
        return ranks_root(work, model) / stem
    return ranks_root(work, model) / ctag / ftag / stem


def checkpoint_dir(work: str, model: str, ctag: str, ftag: str, tag: str, multiple: int | str,
                   rank_method: str) -> Path:
    # Uniform ranks use no Fisher scores, so their checkpoints must not depend on the Fisher setting.
    ftag = "no-fisher" if rank_method == "uniform" else ftag
    return palu_root(work, model) / ctag / ftag / f"{tag}-m{multiple}"


def fitted_capture_path(work: str, model: str, kind: str, windows: str) -> Path:
    """The calibration activations every state of a fitted method (`kind`) on these windows is
    fitted from."""
    return Path(work) / kind / model / windows / "activations.safetensors"


def fitted_dir(work: str, model: str, kind: str, windows: str, state: str) -> Path:
    """work/<kind>/<model>/<calibration windows>/<state tag>/ (the state's files + manifest)."""
    return Path(work) / kind / model / windows / state


SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=-]*")


class UnsafeNameError(ValueError):
    """A name that would become a path component is not a plain name."""


def safe_name(name, what: str) -> str:
    """`name` if it is one plain path component (letters, digits, `._+=-`, not starting with a
    dot: no separator, no `..`, nothing a shell reads), else UnsafeNameError naming it. Names read
    from artifacts (a checkpoint manifest's tag, its lineage) are untrusted: the manifest's seal is
    an unkeyed sha256 that anyone who edits it can recompute."""
    if not isinstance(name, str) or not SAFE_NAME.fullmatch(name) or len(name) > 200:
        raise UnsafeNameError(f"{what} {name!r} is not a plain name (letters, digits and ._+=- only, "
                              "not starting with '.'): refused as a path component")
    return name


def run_name(method_tag: str, lineage: tuple[str, ...] = ()) -> str:
    """A run's folder under results/runs/<model>/: the method's tag, then what it was made from
    (each a plain name: a tag or lineage read from a manifest is checked here)."""
    return "/".join([safe_name(method_tag, "method tag"), *(safe_name(x, "lineage") for x in lineage)])


def evaluation_tag(corpus: str, seqlen: int | str, max_tokens: int | str | None, dtype: str,
                   calibration_fraction: float | str, bos: str = "auto") -> str:
    """Every evaluation setting that changes a perplexity: corpus, window, token budget, the
    model's dtype, the stand-ins' calibration / evaluation split, the BOS choice."""
    return (f"ppl-{corpus}-L{seqlen}-T{tokens_tag(max_tokens)}-{dtype}"
            f"-cf{fmt_ratio(calibration_fraction)}{bos_tag(bos)}")


def metrics_path(results: str, model: str, run: str, corpus: str, seqlen: int | str,
                 max_tokens: int | str | None, dtype: str = "float32",
                 calibration_fraction: float | str = 0.3, bos: str = "auto") -> Path:
    """results/runs/<model>/<run>/<evaluation tag>.json; `run` = `run_name(...)`."""
    return (Path(results) / "runs" / model / run /
            f"{evaluation_tag(corpus, seqlen, max_tokens, dtype, calibration_fraction, bos)}.json")


# ---- the same names from a validated step config (what the entry points call) ------------------
def calibration_tag_of(cfg) -> str:
    c = cfg.calibration
    return calibration_tag(c.corpus, c.samples, c.seqlen, c.seed, cfg.model.dtype, c.bos)


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
                      p.rank_method, p.kept_ratio, p.group_size, p.rank_multiple, p.head_order)


def checkpoint_dir_of(cfg) -> Path:
    p = cfg.palu
    tag = checkpoint_tag(p.decomposition, p.rank_method, p.kept_ratio, p.group_size,
                         rotation_tag(p.rotation, p.rotation_seed) + head_order_tag(p.head_order))
    return checkpoint_dir(cfg.paths.work, cfg.model.name, calibration_tag_of(cfg),
                          fisher_tag_of(cfg), tag, p.rank_multiple, p.rank_method)


def by_hand(work: str) -> Path:
    """Where a step run by hand (without `out=`) writes its results: inside the work folder, so
    it never replaces a committed result of the pipeline (which always passes `out=`)."""
    return Path(work) / "results"


def metrics_path_of(cfg, method) -> Path:
    """A step config's result file for `method` when run by hand (a Palu method reads its
    checkpoint's manifest for the lineage): `by_hand` + the pipeline's layout."""
    d = cfg.data
    run = run_name(method.tag, method.lineage())
    return metrics_path(str(by_hand(cfg.paths.work)), cfg.model.name, run, d.corpus, d.seqlen,
                        d.max_tokens, cfg.model.dtype, d.calibration_fraction, d.bos)


def memory_path(results: str, model: str, run: str, context: int | str, corpus: str) -> Path:
    """results/memory/<model>/<run>/generate-<corpus>-ctx<context>.json: one method's measured
    cache bytes at a `context`-token prefill, and its greedy text (step generate)."""
    return Path(results) / "memory" / model / run / f"generate-{corpus}-ctx{context}.json"


def zeroshot_tag(source: str, limit: int | str | None, dtype: str) -> str:
    """Every setting that changes a zero-shot accuracy: the task source, samples per task, dtype
    (the task list is the table's, fixed per grid)."""
    return f"zeroshot-{source}-n{tokens_tag(limit)}-{dtype}"


def zeroshot_path(results: str, model: str, run: str, source: str, limit: int | str | None,
                  dtype: str) -> Path:
    """results/zeroshot/<model>/<run>/<zeroshot tag>.json (step zeroshot)."""
    return Path(results) / "zeroshot" / model / run / f"{zeroshot_tag(source, limit, dtype)}.json"


def zeroshot_path_of(cfg, method) -> Path:
    z = cfg.zeroshot
    return zeroshot_path(str(by_hand(cfg.paths.work)), cfg.model.name,
                         run_name(method.tag, method.lineage()), z.source, z.limit, cfg.model.dtype)


def longcontext_path(results: str, model: str, run: str, tag: str) -> Path:
    """results/longcontext/<model>/<run>/<longcontext tag>.json (step longcontext)."""
    return Path(results) / "longcontext" / model / run / f"{tag}.json"


def longcontext_tag_of(cfg, settings) -> str:
    """The result name of the suite the config picks: the suite's own tag of its `settings`
    (`config.suite_settings(cfg)`; passed in, so naming imports nothing of the pipeline)."""
    from palu.eval.suites import get_suite
    return get_suite(cfg.longcontext.suite).tag(settings, cfg.model.dtype)


def longcontext_path_of(cfg, method, settings) -> Path:
    return longcontext_path(str(by_hand(cfg.paths.work)), cfg.model.name,
                            run_name(method.tag, method.lineage()), longcontext_tag_of(cfg, settings))


def log_path(work: str, model: str, step: str, name: str) -> Path:
    """A rule's log file (Snakemake `log:`), by model: two grids' runs of one method never share one."""
    return Path(work) / "logs" / model / step / f"{name}.log"


def benchmark_path(work: str, model: str, step: str, name: str) -> Path:
    """A rule's timing file (Snakemake `benchmark:`), by model as the logs."""
    return Path(work) / "benchmarks" / model / step / f"{name}.tsv"


def table_prefix(results: str, table: str) -> Path:
    """results/tables/<table>: the collect step writes <prefix>.csv and <prefix>.md."""
    return Path(results) / "tables" / table


def figure_path(results: str, name: str) -> Path:
    return Path(results) / "figures" / f"{name}.png"


def gpu_results_dir(results: str, bench: str) -> Path:
    """results/<bench>/: the committed GPU benchmark JSON (`latency`, `decode`)."""
    return Path(results) / bench
