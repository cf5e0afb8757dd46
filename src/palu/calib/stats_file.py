"""Calibration statistics on disk (the Gram and Fisher steps' safetensors files), with sealed
metadata that names the model they were measured on.

The metadata records the model's attention-weight hash (`decompose.checkpoint.source_hash`) and
its config fingerprint; a step that reads the file for a model checks them against that model,
so statistics of another model of the same shapes are refused, and an edited value is found.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..artifacts import IntegrityError, atomic_path, check_finite, seal, tensors_sha256, unseal


class StatisticsMismatchError(ValueError):
    """The statistics were measured on another model."""


def model_identity(model) -> dict:
    from ..decompose.checkpoint import source_hash
    from ..models.adapters import config_fingerprint
    return {"hash": source_hash(model), "config": config_fingerprint(model.config),
            "dtype": dtype_name(model)}


def dtype_name(model) -> str:
    """The dtype a model's weights were loaded in ("float32"): what its attention hash is of."""
    return str(model.dtype).removeprefix("torch.")


def save_stats(path: str | Path, tensors: dict[str, torch.Tensor], meta: dict, model) -> None:
    """Refuses non-finite statistics; the seal covers the tensors' bytes too."""
    tensors = {k: v.cpu().contiguous() for k, v in tensors.items()}
    check_finite(tensors, f"statistics for {path}")
    record = seal({**meta, "model": model_identity(model), "tensors_sha256": tensors_sha256(tensors)})
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"palu": json.dumps(record, sort_keys=True)})


def load_stats(path: str | Path, what: str) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors and the checked metadata of a statistics file."""
    path = Path(path)
    with safe_open(str(path), "pt") as f:
        raw = (f.metadata() or {}).get("palu")
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if raw is None:
        raise IntegrityError(f"{what} {path} has no sealed metadata (written by an older palu): "
                             "run its step again")
    meta = unseal(json.loads(raw), f"{what} {path}")
    # files of earlier versions sealed their metadata only; theirs are checked for finiteness alone
    if "tensors_sha256" in meta and tensors_sha256(tensors) != meta["tensors_sha256"]:
        raise IntegrityError(f"{what} {path}: its tensors were changed after it was written "
                             "(their sha256 differs from the sealed one): run its step again")
    try:
        check_finite(tensors, f"{what} {path}")
    except ValueError as err:
        raise IntegrityError(str(err)) from None
    return tensors, meta


def check_model(meta: dict, config, model_hash: str | None = None, what: str = "statistics",
                dtype: str | None = None) -> None:
    """Refuse an artifact of another model: by its config always, by its attention weights'
    hash where the reader has the model loaded (`model_hash`, of weights in `dtype`) and the
    artifact recorded one; a copy of the model in another dtype is named as such."""
    from ..models.adapters import config_fingerprint
    made = meta.get("model") or {}
    if made.get("config") != config_fingerprint(config):
        raise StatisticsMismatchError(f"{what} were made for a model of other shapes or vocabulary "
                                      f"(fingerprint {made.get('config')}, this one {config_fingerprint(config)})")
    if model_hash is not None and made.get("hash") not in (None, model_hash):
        if made.get("dtype") and dtype and made["dtype"] != dtype:
            raise StatisticsMismatchError(f"{what} were made from the model loaded in {made['dtype']}; "
                                          f"the model given is in {dtype} (its attention weights "
                                          f"differ): load it in {made['dtype']} (model.dtype)")
        raise StatisticsMismatchError(f"{what} were made from another model (attention hash "
                                      f"{str(made['hash'])[:12]}…, this one {model_hash[:12]}…)")
