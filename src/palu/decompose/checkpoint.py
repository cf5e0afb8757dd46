"""Compressed checkpoints: the factors (safetensors), a config and a manifest.

The manifest names the source model and a hash of its attention weights, the ranks, the methods,
every calibration setting and the sha256 of the factors file. Loading against a different base
model fails with both hashes; a factors file whose bytes changed (same size or not) is refused.
"""
from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..attention.install import install_palu
from ..artifacts import (IntegrityError, atomic_dir, check_finite, read_json, seal, sha256_file, unseal,
                         write_json)
from ..models.adapters import adapter_for, geometry_of
from .factors import LayerFactors
from .ranks import check_allocation, ranks_table

SAVED_DTYPES = (torch.float32, torch.float64)   # see factors.stored_dtype
FORMAT_VERSION = 3   # 2: the manifest holds the sha256 of factors.safetensors; 3: and is sealed
FACTORS = "factors.safetensors"


def rotation_tag(rotation: str, seed: int | str = 0) -> str:
    """The suffix a latent rotation adds to a checkpoint's tag ('' for none)."""
    return "" if rotation == "none" else f"-rot_{rotation}-s{seed}"


def head_order_tag(head_order) -> str:
    """The suffix a similarity head order adds to a checkpoint's tag ('' for the model's own)."""
    return "" if head_order in (None, "none") else "-heads_similarity"


def checkpoint_tag(decomposition: str, rank_method: str, kept_ratio: float | str, group_size: int | str,
                   rotation: str = "") -> str:
    """A checkpoint's name from the settings that make it (`kept_ratio` may be a Snakemake
    wildcard string, passed through as written; `rotation`: a `rotation_tag`)."""
    kept = kept_ratio if isinstance(kept_ratio, str) else f"{float(kept_ratio):g}"
    return f"palu-{decomposition}-{rank_method}-k{kept}-g{group_size}{rotation}"


class CheckpointError(ValueError):
    """A compressed checkpoint is missing, corrupt, or belongs to another model."""


def source_hash(model) -> str:
    """sha256 over the float32 bytes of every attention projection weight, in layer order."""
    adapter = adapter_for(model.config)
    weights = []
    for layer in adapter.layers(model):
        attn = adapter.attention(layer)
        if getattr(attn, "stores_latents", False) or getattr(attn, "quantises_kv", False):
            raise CheckpointError("the model already has Palu attention installed; load a fresh base model")
        weights += [proj.weight for proj in adapter.projections(attn)]
    return sha256_in_order(weights)


def sha256_in_order(weights) -> str:
    """sha256 over each tensor's float32 bytes, in order: the next one's conversion and copy to the
    host overlap this one's hashing (hashlib lets go of the GIL), and the hash reads the array's
    buffer without a bytes copy. The digest is the one-by-one loop's; a 7B model's every job
    checks it (16 s of its 20-s install on an H100 one by one, `results/tables/scale.md`)."""
    h = hashlib.sha256()
    with ThreadPoolExecutor(1) as pool:
        host = lambda w: w.detach().float().cpu().contiguous().numpy()   # noqa: E731
        pending = pool.submit(host, weights[0]) if weights else None
        for i in range(len(weights)):
            array = pending.result()
            pending = pool.submit(host, weights[i + 1]) if i + 1 < len(weights) else None
            h.update(array)
    return h.hexdigest()


def save_compressed(out_dir: str | Path, factors: list[LayerFactors], manifest: dict) -> Path:
    tensors = {}
    for l, lf in enumerate(factors):
        for kind in ("k", "v"):
            for g, (A, B) in enumerate(zip(getattr(lf, f"A_{kind}"), getattr(lf, f"B_{kind}"))):
                if A.dtype not in SAVED_DTYPES or B.dtype not in SAVED_DTYPES:
                    raise ValueError(f"layer {l}: factors in {A.dtype}/{B.dtype}; checkpoints keep "
                                     f"them as decompose_model returns them ({SAVED_DTYPES})")
                tensors[f"layers.{l}.{kind}.{g}.A"] = A.contiguous()
                tensors[f"layers.{l}.{kind}.{g}.B"] = B.contiguous()
    check_finite(tensors, f"Palu factors for {out_dir}")
    with atomic_dir(out_dir, "manifest.json") as tmp:
        save_file(tensors, str(tmp / FACTORS))
        # sealed: an edited setting (kept ratio, group size, tag) is refused when read
        write_json(tmp / "manifest.json", seal({**manifest, "format_version": FORMAT_VERSION,
                                                "files": {FACTORS: sha256_file(tmp / FACTORS)}}))
    return Path(out_dir)


def read_manifest(path: str | Path) -> dict:
    path = Path(path)
    if not (path / "manifest.json").is_file():
        raise CheckpointError(f"{path} is not a Palu checkpoint (no manifest.json)")
    try:
        manifest = read_json(path / "manifest.json")
    except ValueError as err:
        raise CheckpointError(str(err)) from err
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format_version {manifest.get('format_version')!r}, "
                              f"expected {FORMAT_VERSION} (made by an older palu: decompose it again)")
    try:
        return unseal(manifest, f"checkpoint manifest {path / 'manifest.json'}")
    except IntegrityError as err:
        raise CheckpointError(str(err)) from None


def verify_files(path: str | Path, manifest: dict) -> None:
    """Every file the manifest lists has the bytes it had when saved (sha256)."""
    for name, expected in manifest["files"].items():
        file = Path(path) / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing")
        actual = sha256_file(file)
        if actual != expected:
            raise CheckpointError(f"{file} is corrupt: sha256 {actual[:16]}… but the manifest "
                                  f"recorded {expected[:16]}… when it was saved")


def load_factors(path: str | Path, num_layers: int, n_groups: int) -> list[LayerFactors]:
    verify_files(path, read_manifest(path))
    try:
        tensors = load_file(str(Path(path) / FACTORS))
    except (SafetensorError, FileNotFoundError, OSError) as err:
        raise CheckpointError(f"{path}/factors.safetensors is missing or corrupt: {err}") from err
    factors = []
    try:
        for l in range(num_layers):
            lf = LayerFactors()
            for kind in ("k", "v"):
                for g in range(n_groups):
                    getattr(lf, f"A_{kind}").append(tensors[f"layers.{l}.{kind}.{g}.A"])
                    getattr(lf, f"B_{kind}").append(tensors[f"layers.{l}.{kind}.{g}.B"])
            factors.append(lf)
    except KeyError as err:
        raise CheckpointError(f"{path}: factor tensor {err} is missing (corrupt checkpoint?)") from None
    return factors


def check_factors(path, factors: list[LayerFactors], allocation: dict, geom) -> None:
    """The factors are the allocation's: every block's A (rank, hidden) and B (group rows, rank),
    so group size and ranks come from the tensors, never from the manifest alone."""
    try:
        check_allocation(allocation, geom, f"checkpoint {path}")
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    rows, ranks = allocation["group_size"] * geom.head_dim, ranks_table(allocation)
    for l, lf in enumerate(factors):
        for kind in ("k", "v"):
            for g, (A, B) in enumerate(zip(getattr(lf, f"A_{kind}"), getattr(lf, f"B_{kind}"))):
                r = ranks[(l, kind, g)]
                if tuple(A.shape) != (r, geom.hidden_size) or tuple(B.shape) != (rows, r):
                    raise CheckpointError(
                        f"checkpoint {path}: layer {l} {kind} group {g} has factors A {tuple(A.shape)}, "
                        f"B {tuple(B.shape)}, but its manifest says rank {r} and group size "
                        f"{allocation['group_size']} (A ({r}, {geom.hidden_size}), B ({rows}, {r}))")


def load_compressed(model, path: str | Path, fuse: bool | None = None) -> dict:
    """Install the checkpoint's Palu attention into `model` (its matching base); return the manifest."""
    manifest = read_manifest(path)
    expected, actual = manifest["source"]["hash"], source_hash(model)
    if expected != actual:
        made_in, given = manifest["source"].get("dtype"), str(model.dtype).removeprefix("torch.")
        if made_in is not None and made_in != given:   # the hash is of the weights as loaded
            raise CheckpointError(
                f"checkpoint {path} was made from {manifest['source']['model_id']!r} loaded in "
                f"{made_in}; the model given is in {given}, and its attention weights differ "
                f"(hash {actual[:12]}… vs {expected[:12]}…): load the model in {made_in} "
                f"(model.dtype={made_in}), or compress the {given} copy")
        raise CheckpointError(
            f"checkpoint {path} was made from {manifest['source']['model_id']!r} "
            f"(attention hash {expected[:12]}…) but the model given ({given}) has hash {actual[:12]}…")
    geom = geometry_of(model.config)
    s = manifest["allocation"]["group_size"]
    try:
        n_groups = geom.check_group_size(s)
    except ValueError as err:
        raise CheckpointError(f"checkpoint {path}: {err}") from None
    factors = load_factors(path, geom.num_layers, n_groups)
    check_factors(path, factors, manifest["allocation"], geom)
    try:
        check_finite({f"layers.{l}.{kind}.{g}.{ab}": t for l, lf in enumerate(factors) for kind in "kv"
                      for ab in "AB" for g, t in enumerate(getattr(lf, f"{ab}_{kind}"))},
                     f"checkpoint {path}")
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    if manifest.get("head_order"):        # the factors are in the reordered heads' order
        from .heads import reorder_heads
        reorder_heads(model, manifest["head_order"])
    install_palu(model, factors, s, fuse=manifest["fuse"] if fuse is None else fuse)
    # what the tables report, from the tensors installed (check_factors: the manifest agrees)
    kept = sum(A.shape[0] for lf in factors for A in lf.A_k + lf.A_v) / (geom.num_layers * geom.kv_size())
    return {**manifest, "installed": {"group_size": factors[0].B_k[0].shape[0] // geom.head_dim,
                                      "kept_ratio_realised": kept}}
