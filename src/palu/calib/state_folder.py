"""A fitted method's state on disk: one folder with `state.safetensors` and a sealed
`manifest.json` (what it is, how it was fitted, the tensors' sha256), written atomically. A state
whose manifest was edited or whose tensors changed is refused by name (KVQuant's codebooks,
KIVI's value scales)."""
from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from ..artifacts import atomic_dir, seal, sha256_file, unseal

TENSORS = "state.safetensors"


def save_state(path: str | Path, tensors: dict, manifest: dict) -> None:
    """`manifest` holds `format`, `method`, `tag` and the fitting settings; the file's sha256
    and the seal are added here."""
    with atomic_dir(path, "manifest.json") as tmp:
        save_file(tensors, str(tmp / TENSORS))
        sealed = seal({**manifest, "files": {TENSORS: sha256_file(tmp / TENSORS)}})
        (tmp / "manifest.json").write_text(json.dumps(sealed, indent=2, sort_keys=True) + "\n")


def load_state(path: str | Path, method: str, fmt: int, what: str, fit_with: str) -> tuple[dict, dict]:
    """The manifest and tensors of a `method` state of format `fmt`; `what` names it in errors
    ("KVQuant state"), `fit_with` says how to make one."""
    path = Path(path)
    if not (path / "manifest.json").is_file():
        raise FileNotFoundError(f"{path}: no {what} (manifest.json); fit one with {fit_with}")
    manifest = json.loads((path / "manifest.json").read_text())
    if manifest.get("format") != fmt or manifest.get("method") != method:
        raise ValueError(f"{path}: not a format-{fmt} {what}")
    manifest = unseal(manifest, f"{what} {path / 'manifest.json'}")
    if sha256_file(path / TENSORS) != manifest["files"][TENSORS]:
        raise ValueError(f"{path}/{TENSORS} does not match its manifest's sha256: "
                         "the file was changed or damaged; fit it again")
    return manifest, load_file(str(path / TENSORS))
