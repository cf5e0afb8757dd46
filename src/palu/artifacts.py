"""Atomic writes: an interrupted step never leaves a file that looks complete."""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator


def _as_created(path: Path, directory: bool) -> None:
    """The mode an ordinary file or folder gets under the user's umask: one policy for every
    artifact (mkstemp / mkdtemp and safetensors' writer make 0600 / 0700: results nobody else
    could read, beside manifests anyone could)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, (0o777 if directory else 0o666) & ~mask)


@contextlib.contextmanager
def atomic_dir(target: str | Path, marker: str) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it is renamed to `target`. An existing
    `target` is replaced only when it is an artifact of the same kind (it holds `marker`, the
    file every such artifact writes) or empty: a save never deletes a folder of other files
    (FileExistsError naming them, before any work and before anything is written)."""
    target = Path(target)
    _check_replaceable(target, marker)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        for path in (tmp, *tmp.rglob("*")):   # what writers make 0600 (safetensors) reads as any file
            if not path.is_symlink():
                _as_created(path, directory=path.is_dir())
        if target.exists():
            _check_replaceable(target, marker)
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _check_replaceable(target: Path, marker: str) -> None:
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise FileExistsError(f"{target} exists and is not a folder: refusing to replace it")
    if not target.exists() or (target / marker).is_file():
        return
    held = sorted(p.name for p in target.iterdir())
    if held:
        raise FileExistsError(f"{target} holds {len(held)} file(s) of something else "
                              f"({', '.join(held[:5])}{', ...' if len(held) > 5 else ''}), no {marker}: "
                              "saving there would delete them; choose a new or empty folder")


@contextlib.contextmanager
def atomic_path(target: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling file path; on success it replaces `target`."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent,
                                suffix=target.suffix)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        _as_created(tmp, directory=False)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_text(target: str | Path, text: str) -> None:
    with atomic_path(target) as tmp:
        tmp.write_text(text)


class NonFiniteResultError(FloatingPointError):
    """A result holds NaN or inf: nothing is written (a result that cannot be right is an error)."""


def nonfinite_keys(obj: Any, where: str = "") -> list[str]:
    """The dotted keys of every NaN / inf float inside `obj` (dicts, lists, numbers)."""
    if isinstance(obj, float):
        return [] if math.isfinite(obj) else [where or "<value>"]
    if isinstance(obj, dict):
        return [k for key, v in obj.items()
                for k in nonfinite_keys(v, f"{where}.{key}" if where else str(key))]
    if isinstance(obj, (list, tuple)):
        return [k for i, v in enumerate(obj) for k in nonfinite_keys(v, f"{where}[{i}]")]
    return []


def write_json(target: str | Path, obj: Any) -> None:
    """Write `obj` atomically; NaN / inf anywhere is refused (NonFiniteResultError naming the
    keys), so no metric file can hold a number that cannot be right."""
    bad = nonfinite_keys(obj)
    if bad:
        raise NonFiniteResultError(f"refusing to write {target}: non-finite value(s) at "
                                   f"{', '.join(bad[:8])}" + (" ..." if len(bad) > 8 else ""))
    write_text(target, json.dumps(obj, indent=2, sort_keys=True, default=str, allow_nan=False) + "\n")


class IntegrityError(ValueError):
    """An artifact's metadata is not what was written with it (edited, or from an older palu)."""


def _digest(record: dict) -> str:
    canonical = json.dumps({k: v for k, v in record.items() if k != "integrity"}, sort_keys=True,
                           separators=(",", ":"), default=str, allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def seal(record: dict) -> dict:
    """`record` with an integrity field: the sha256 of everything else in it (canonical JSON), so
    an edit of any value is found when it is read (`unseal`)."""
    return {**record, "integrity": _digest(record)}


def unseal(record: dict, what: str) -> dict:
    """`record` without its integrity field, after checking it; IntegrityError naming `what`."""
    if "integrity" not in record:
        raise IntegrityError(f"{what} has no integrity record (written by an older palu, or by "
                             "hand): make it again with the step that writes it")
    if record["integrity"] != _digest(record):
        raise IntegrityError(f"{what} was edited after it was written (its integrity record does "
                             "not match its contents): make it again instead of editing it")
    return {k: v for k, v in record.items() if k != "integrity"}


def check_finite(tensors: dict, what: str) -> None:
    """ValueError naming the first tensor of `tensors` (name -> tensor) holding NaN or inf: such
    a factor or statistic would install and turn every logit after it non-finite."""
    import torch
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise ValueError(f"{what}: tensor {name!r} holds {bad} non-finite value(s) (NaN / inf)")


def tensors_sha256(tensors: dict) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order."""
    import torch
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def read_json(path: str | Path) -> Any:
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON (corrupt or half-written?): {err}") from err
