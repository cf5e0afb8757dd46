"""What a compressed checkpoint was made from, as path components (its *lineage*).

A result is named by its method's tag, then its lineage (`Palu.lineage()`): two checkpoints of the
same ranks made from other calibration windows never share a result folder. The pipeline names
its calibration and Fisher files with the same tags, so these functions are the one source of the
names on both sides.
"""
from __future__ import annotations


def bos_tag(bos: str) -> str:
    # `auto` follows the model's own tokenizer, so the model in the path already fixes it; an
    # explicit choice that may differ from the model's convention is named
    return "" if bos == "auto" else f"-bos_{bos}"


def calibration_tag(corpus: str, samples: int, seqlen: int, seed: int, dtype: str = "float32",
                    bos: str = "auto") -> str:
    """Every setting that changes the calibration statistics (and so every checkpoint made from
    them): corpus, windows, seed, the dtype the model ran in, the BOS choice."""
    return f"{corpus}-n{samples}-L{seqlen}-s{seed}-{dtype}{bos_tag(bos)}"


def fisher_tag(samples: int, seqlen: int, seed: int) -> str:
    return f"fisher-n{samples}-L{seqlen}-s{seed}"


def palu_lineage(ctag: str, ftag: str, rank_method: str, multiple: int | str) -> tuple[str, ...]:
    """A checkpoint's lineage from its calibration and Fisher tags: uniform ranks read no Fisher
    scores, so they name none."""
    return (ctag, f"{'no-fisher' if rank_method == 'uniform' else ftag}-m{multiple}")


def lineage_of(manifest: dict) -> tuple[str, ...]:
    """A checkpoint's lineage from its manifest: its calibration and Fisher settings and rank
    multiple (checkpoints of the pipeline's decompose step), else the sha256 of its factors (a
    checkpoint saved by `palu.compress(...).save`, whose calibration has no name)."""
    settings = manifest.get("settings") or {}
    cal, allocation = settings.get("calibration"), manifest["allocation"]
    if not cal:
        return (f"checkpoint-{manifest['files']['factors.safetensors'][:12]}",)
    ctag = calibration_tag(cal["corpus"], cal["samples"], cal["seqlen"], cal["seed"],
                           settings.get("calibration_dtype", "float32"), cal.get("bos", "auto"))
    fisher = settings["fisher"]
    return palu_lineage(ctag, fisher_tag(fisher["samples"], fisher["seqlen"], fisher["seed"]),
                        allocation["method"], allocation["multiple"])
