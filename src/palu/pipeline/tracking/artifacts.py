"""What a step used and made, described as W&B artifacts.

An artifact's name comes from its path (so the same output of the same settings is always the
same artifact, and a rerun adds a version instead of a second artifact); its fingerprint is a
sampled content hash, so a consumer can say which version it read without hashing gigabytes of
weights again. The bytes themselves go to W&B only when asked
(`tracking.upload`): by default files up to 1 MiB (results, rank files) are uploaded and larger
ones (weights, statistics) are logged by reference to the work folder.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

# The kinds of things the pipeline makes, in DAG order (an artifact's W&B type).
# A fitted method's capture and state are `<method>_activations` and `<method>_state` (`kinds()`).
KINDS = ("model", "gram", "fisher", "ranks", "checkpoint",
         "metrics", "memory", "zeroshot", "longcontext", "table", "figure", "benchmark")
UPLOADS = ("none", "small", "all")
SMALL_BYTES = 1 << 20
_MAX_NAME = 120                    # W&B allows 128 characters
_WHOLE_BYTES, _BLOCK, _BLOCKS = 8 << 20, 64 << 10, 32


def files_of(path: str | Path) -> list[Path]:
    """The files of an output (itself, or a folder's files sorted, hidden ones left out: Snakemake
    drops a `.snakemake_timestamp` into folder outputs after the step)."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"cannot track {path}: no such file or folder")
    return sorted(p for p in path.rglob("*")
                  if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))


def _file_digest(f: Path, h) -> None:
    size = f.stat().st_size
    h.update(f"{size}\0".encode())
    with f.open("rb") as fh:
        if size <= _WHOLE_BYTES:
            h.update(fh.read())
            return
        for i in range(_BLOCKS):            # evenly spaced blocks, the first and the last included
            fh.seek(i * (size - _BLOCK) // (_BLOCKS - 1))
            h.update(fh.read(_BLOCK))


def fingerprint(path: str | Path) -> str:
    """A cheap identity of an output's contents: every file's name and size, and its bytes (whole
    up to 8 MiB, else 32 blocks of 64 KiB spread over it), so weights are not hashed again by each
    consumer. Modification times are left out: Snakemake touches every output after its job."""
    root = Path(path)
    h = hashlib.sha256()
    for f in files_of(root):
        rel = f.name if f == root else f.relative_to(root).as_posix()
        h.update(f"{rel}\0".encode())
        _file_digest(f, h)
    return h.hexdigest()[:32]


def kinds() -> tuple[str, ...]:
    """Every artifact kind: `KINDS` and each fitted method's (palu.pipeline.fitted)."""
    from palu.pipeline.fitted import FITTED
    fitted = tuple(f"{k}_{what}" for k in FITTED for what in ("activations", "state"))
    return KINDS[:5] + fitted + KINDS[5:]


def artifact_name(kind: str, path: str | Path) -> str:
    """`<kind>-<path relative to the current folder, '/' as '.'>`, shortened with a hash where
    W&B's length limit requires it."""
    if kind not in kinds():
        raise ValueError(f"artifact kind {kind!r} is not one of {list(kinds())}")
    full = Path(path).resolve()
    try:
        rel = full.relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        rel = full.as_posix().lstrip("/")
    slug = re.sub(r"[^A-Za-z0-9_.-]", "_", rel.replace("/", "."))
    name = f"{kind}-{slug}"
    if len(name) > _MAX_NAME:
        digest = hashlib.sha256(name.encode()).hexdigest()[:12]
        name = f"{name[:_MAX_NAME - 13]}-{digest}"
    return name


def describe(kind: str, path: str | Path) -> dict:
    """The record of one artifact a run used or made (kept in the run's config / metadata)."""
    return {"kind": kind, "name": artifact_name(kind, path), "path": str(path),
            "fingerprint": fingerprint(path)}


def alias_of(fp: str) -> str:
    """The version alias naming one fingerprint (a consumer asks for exactly what it read)."""
    return f"fp-{fp[:16]}"


def build(kind: str, path: str | Path, upload: str, metadata: dict | None = None):
    """A W&B artifact of `path`: files uploaded or referenced per `upload` (none | small | all)."""
    import wandb
    if upload not in UPLOADS:
        raise ValueError(f"tracking.upload={upload!r} is not one of {list(UPLOADS)}")
    root = Path(path)
    info = describe(kind, root)
    art = wandb.Artifact(info["name"], type=kind,
                         metadata={"path": str(root), "fingerprint": info["fingerprint"],
                                   **(metadata or {})})
    for f in files_of(root):
        name = f.name if f == root else f.relative_to(root).as_posix()
        size = f.stat().st_size
        if upload == "all" or (upload == "small" and size <= SMALL_BYTES):
            art.add_file(str(f), name=name)
        else:
            art.add_reference(f.resolve().as_uri(), name=name)
    return art, info
