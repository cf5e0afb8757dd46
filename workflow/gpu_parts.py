"""Files for a GPU host whose transfers are capped: one bundle, cut into parts that each fit one
transfer, checked part by part on arrival and as a whole before anything is unpacked.

    python workflow/gpu_parts.py split work/gpu-parts work/wheelhouse [more paths] [--part-mib auto]
    # one transfer per part: the folder work/gpu-parts/pK (its part and the manifest)
    python3 workflow/gpu_parts.py stage work/gpu-parts/pK /tmp/palu-stage     # on the host, each
    python3 workflow/gpu_parts.py join /tmp/palu-stage .                      # on the host, last

Why: the device calls this project uses carry at most 64 MiB with the checkout (46 MiB of it
tracked files in session 38; `--part-mib auto` sizes the parts to what is left), and the machine keeps what a call wrote outside the checkout only while it stays
warm (README, "Run on a GPU host without internet"). `split` tars the given paths (relative to the
checkout; no absolute path, none outside it) and cuts the tar into parts; `manifest.json` holds
each part's sha256 and the whole's. `stage` copies one part beside the others, refusing a part
whose sha256 or bundle differs from its manifest; `join` refuses a missing part or a whole whose
sha256 differs, then unpacks into the root with tarfile's `data` filter (no member outside the
root, no links out, no devices) and never over an existing file of other content.
Standard library only: it runs on the host before anything is installed.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

MANIFEST = "manifest.json"
CHUNK = 1 << 20
# what one device call carries: the checkout's tracked and untracked-not-ignored files plus the
# carried paths, counted as disk use (blocks: a 17-MiB part beside 46.07 MiB of tracked files went,
# a 19-MiB one was refused, session 38)
LIMIT_MIB = 64.0
MARGIN_MIB = 0.5


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def _inside(root: Path, rel: str) -> Path:
    """`rel` as a path inside `root` (an error otherwise: absolute, `..`, or a link out)."""
    if Path(rel).is_absolute():
        raise SystemExit(f"{rel!r}: give paths relative to the checkout")
    path = (root / rel).resolve()
    if not path.is_relative_to(root.resolve()):
        raise SystemExit(f"{rel!r} lies outside {root}")
    if not path.exists():
        raise SystemExit(f"{rel!r}: no such file or folder under {root}")
    return path


def travelling_mib(root: Path) -> float:
    """Disk use, in MiB of blocks, of the checkout's files that travel with every call."""
    listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], capture_output=True, check=True).stdout
    total = 0
    for rel in filter(None, listed.decode().split("\0")):
        path = root / rel
        if path.is_file() and not path.is_symlink():
            total += os.stat(path).st_blocks * 512
    return total / 2**20


def auto_part_mib(root: Path, limit: float = LIMIT_MIB) -> float:
    """The largest part (in steps of 0.5 MiB) that travels beside the checkout within `limit`:
    what is left after the travelling files, a part's manifest block and a margin."""
    room = limit - travelling_mib(root) - MARGIN_MIB - 4 / 1024
    if room < 1:
        raise SystemExit(f"the checkout's travelling files leave {room:.2f} MiB of the {limit:g} MiB a call "
                         "carries: too little for a part (ignore or carry less)")
    return math.floor(room * 2) / 2


def split(out: Path, paths: list[str], part_mib: float, root: Path = Path(".")) -> dict:
    if part_mib <= 0:
        raise SystemExit(f"--part-mib {part_mib}: must be positive")
    for rel in paths:
        _inside(root, rel)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} is not empty: give a new folder (nothing there is overwritten)")
    out.mkdir(parents=True, exist_ok=True)
    size = int(part_mib * 2**20)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        bundle = Path(tmp) / "bundle.tar"
        with tarfile.open(bundle, "w", format=tarfile.PAX_FORMAT) as tar:
            for rel in paths:
                tar.add(root / rel, arcname=rel)
        whole = _sha256(bundle)
        parts = []
        with open(bundle, "rb") as fh:
            while block := fh.read(size):
                name = f"part{len(parts):03d}"
                parts.append({"name": name, "bytes": len(block), "sha256": hashlib.sha256(block).hexdigest()})
                (out / f"p{len(parts) - 1}").mkdir()
                (out / f"p{len(parts) - 1}" / name).write_bytes(block)
    manifest = {"bundle_sha256": whole, "bytes": sum(p["bytes"] for p in parts), "paths": list(paths),
                "parts": parts}
    for k in range(len(parts)):
        (out / f"p{k}" / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def stage(part_dir: Path, dest: Path) -> str:
    manifest = json.loads((part_dir / MANIFEST).read_text())
    found = [p for p in manifest["parts"] if (part_dir / p["name"]).is_file()]
    if len(found) != 1:
        raise SystemExit(f"{part_dir} holds {len(found)} parts of its manifest; expected one")
    part = found[0]
    got = _sha256(part_dir / part["name"])
    if got != part["sha256"]:
        raise SystemExit(f"{part['name']}: sha256 {got} differs from the manifest's {part['sha256']}")
    dest.mkdir(parents=True, exist_ok=True)
    if (dest / MANIFEST).is_file():
        held = json.loads((dest / MANIFEST).read_text())["bundle_sha256"]
        if held != manifest["bundle_sha256"]:
            raise SystemExit(f"{dest} holds parts of another bundle ({held[:12]}); stage into a new folder")
    else:
        (dest / MANIFEST).write_text(json.dumps(manifest, indent=1))
    shutil.copyfile(part_dir / part["name"], dest / (part["name"] + ".tmp"))
    (dest / (part["name"] + ".tmp")).replace(dest / part["name"])
    have = sum((dest / p["name"]).is_file() for p in manifest["parts"])
    return f"{part['name']} staged: {have} of {len(manifest['parts'])} parts in {dest}"


def join(staged: Path, root: Path) -> list[str]:
    manifest = json.loads((staged / MANIFEST).read_text())
    missing = [p["name"] for p in manifest["parts"] if not (staged / p["name"]).is_file()]
    if missing:
        raise SystemExit(f"parts {missing} are not staged in {staged}")
    h = hashlib.sha256()
    bundle = staged / "bundle.tar.tmp"
    with open(bundle, "wb") as out:
        for p in manifest["parts"]:
            data = (staged / p["name"]).read_bytes()
            h.update(data)
            out.write(data)
    if h.hexdigest() != manifest["bundle_sha256"]:
        bundle.unlink()
        raise SystemExit(f"the joined bundle's sha256 {h.hexdigest()} differs from {manifest['bundle_sha256']}")
    written = []
    try:
        with tarfile.open(bundle) as tar:
            for member in tar.getmembers():
                target = root / member.name
                if member.isfile() and target.is_file():   # already here: kept if the same, else refused
                    if target.read_bytes() != tar.extractfile(member).read():
                        raise SystemExit(f"{target} exists with other content: not overwritten (move it away first)")
                    continue
                tar.extract(member, root, filter="data")
                written.append(member.name)
    finally:
        bundle.unlink()
    return written


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split")
    s.add_argument("out", type=Path)
    s.add_argument("paths", nargs="+")
    s.add_argument("--part-mib", default="auto",
                   help="MiB a part; auto: what a call carries beside the checkout (auto_part_mib)")
    g = sub.add_parser("stage")
    g.add_argument("part", type=Path)
    g.add_argument("dest", type=Path)
    j = sub.add_parser("join")
    j.add_argument("staged", type=Path)
    j.add_argument("root", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "split":
        if args.part_mib == "auto":
            part_mib = auto_part_mib(Path("."))
            print(f"parts of {part_mib:g} MiB: the checkout's travelling files take "
                  f"{travelling_mib(Path('.')):.2f} of the {LIMIT_MIB:g} MiB a call carries")
        else:
            try:
                part_mib = float(args.part_mib)
            except ValueError:
                raise SystemExit(f"--part-mib {args.part_mib!r}: a number of MiB or auto") from None
        m = split(args.out, args.paths, part_mib)
        print(f"{m['bytes'] / 2**20:.1f} MiB in {len(m['parts'])} parts under {args.out} "
              f"(sha256 {m['bundle_sha256'][:12]}); carry {args.out}/p0 .. p{len(m['parts']) - 1}, "
              f"one a call, then join")
    elif args.cmd == "stage":
        print(stage(args.part, args.dest))
    else:
        written = join(args.staged, args.root)
        print(f"unpacked {len(written)} entries into {args.root}")


if __name__ == "__main__":
    sys.exit(main())
