"""Reading offline W&B runs back, and the lineage of a result through them.

A run folder (`<tracking.dir>/wandb/offline-run-*`) holds a `.wandb` transaction log; W&B's own
reader `wandb leet inspect --json` prints its records, one JSON object a line. From those we keep
what a researcher asks of a run: its config, summary, the artifacts it made and the ones its config
says it used, and the media (tables, images, plots) it logged.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from palu.pipeline.tracking.artifacts import artifact_name


@dataclass
class OfflineRun:
    id: str
    folder: Path
    job_type: str
    name: str
    group: str
    config: dict
    start_time: str = ""
    summary: dict = field(default_factory=dict)
    made: list[dict] = field(default_factory=list)   # name, type, digest, aliases, metadata, files
    media: dict[str, str] = field(default_factory=dict)  # logged key -> W&B media type
    plots: dict[str, str] = field(default_factory=dict)  # native plot key -> W&B panel type
    exit_code: int | None = None
    args: list[str] = field(default_factory=list)        # the command line W&B recorded

    @property
    def used(self) -> list[dict]:
        return self.config.get("lineage", {}).get("used", [])


def _wandb_cli() -> str:
    here = Path(sys.executable).with_name("wandb")
    return str(here) if here.is_file() else (shutil.which("wandb") or "wandb")


def records(run_folder: str | Path) -> list[dict]:
    """Every record of an offline run's log, via `wandb leet inspect --json`."""
    out = subprocess.run([_wandb_cli(), "leet", "inspect", "--json", str(run_folder)],
                         capture_output=True, text=True, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


_PLOT = "_wandb.visualize."


def read_run(run_folder: str | Path) -> OfflineRun:
    folder = Path(run_folder)
    run = None
    for rec in records(folder):
        kind = rec["type"]
        if kind == "run":
            r = rec["run"]
            config = {k: v for k, v in r.get("config", {}).get("update", {}).items() if k != "_wandb"}
            run = OfflineRun(r["run_id"], folder, r.get("job_type", ""), r.get("display_name", ""),
                             r.get("run_group", ""), config, r.get("start_time", ""))
        elif run is None:
            continue
        elif kind == "config":
            for key, value in rec["config"].get("update", {}).items():
                if key.startswith(_PLOT):       # a native plot: its panel, over a logged table
                    run.plots[key[len(_PLOT):]] = value["panel_config"]["panelDefId"]
                elif not key.startswith("_wandb"):
                    run.config[key] = value
        elif kind == "summary":
            run.summary.update(rec["summary"].get("update", {}))
        elif kind == "history":
            for key, value in rec["history"].get("item", {}).items():
                if key.endswith("._type"):       # media are logged as flattened keys
                    run.media[key[:-len("._type")]] = value
        elif kind == "artifact":
            a = rec["artifact"]
            run.made.append({"name": a["name"], "type": a["type"], "digest": a["digest"],
                             "aliases": a.get("aliases", []),
                             "metadata": json.loads(a.get("metadata") or "{}"),
                             "files": [c["path"] for c in a.get("manifest", {}).get("contents", [])],
                             "references": [c["ref"] for c in a.get("manifest", {}).get("contents", [])
                                            if c.get("ref")]})
        elif kind == "environment" and "args" in rec["environment"]:   # (the machine's is another record)
            run.args = rec["environment"]["args"]
        elif kind == "exit":
            run.exit_code = rec["exit"].get("exit_code", 0)
    if run is None:
        raise ValueError(f"{folder} holds no W&B run record")
    run.summary = {k: v for k, v in run.summary.items() if not _is_media_field(k, run.media)}
    return run


def _is_media_field(key: str, media: dict) -> bool:
    return any(key.startswith(f"{m}.") for m in media)


def run_folders(wandb_dir: str | Path) -> list[Path]:
    """The offline run folders under a `tracking.dir` that hold a run log (a step killed before
    W&B wrote its first record leaves a folder without one: nothing to read)."""
    return sorted(f for f in (Path(wandb_dir) / "wandb").glob("offline-run-*") if any(f.glob("*.wandb")))


def read_runs(wandb_dir: str | Path) -> list[OfflineRun]:
    """Every offline run, oldest first (by start time: folder names only resolve seconds)."""
    return sorted((read_run(f) for f in run_folders(wandb_dir)), key=lambda r: r.start_time)


def producer_of(name: str, runs: list[OfflineRun], fingerprint: str | None = None):
    """The run that made artifact `name` (the version with this fingerprint where given)."""
    best = None
    for run in runs:
        for art in run.made:
            if art["name"] != name:
                continue
            if fingerprint is None or art["metadata"].get("fingerprint") == fingerprint:
                return run, art
            best = best or (run, art)
    return best


@dataclass
class LineageNode:
    kind: str
    name: str
    path: str
    run: OfflineRun | None            # the run that made it (None: made outside the pipeline)
    exact: bool                       # the producer made exactly the version that was read
    inputs: list["LineageNode"] = field(default_factory=list)


def _kinds_made(path: str | Path, runs: list[OfflineRun]) -> set[str]:
    target = Path(path).resolve()
    return {art["type"] for run in runs for art in run.made
            if Path(art["metadata"].get("path", "")).resolve() == target}


def lineage(path: str | Path, runs: list[OfflineRun], kind: str | None = None) -> LineageNode:
    """The tree of what an output was made from: its producer's inputs, recursively. `kind` is
    the artifact's type; by default the one its producer logged it as."""
    if kind is None:
        kinds = _kinds_made(path, runs)
        if not kinds and Path(path).suffix == ".md" and _kinds_made(Path(path).with_suffix(".csv"), runs):
            path = Path(path).with_suffix(".csv")     # a table's markdown view is written with its CSV
            kinds = _kinds_made(path, runs)
        if len(kinds) != 1:
            raise ValueError(f"no tracked step made {path} (a result committed to git or copied in "
                             "was made elsewhere: rerun its step here, e.g. `snakemake -f <path>`, "
                             "to record its lineage)" if not kinds else
                             f"{path} was logged as several kinds {sorted(kinds)}; pass one")
        kind = kinds.pop()
    return _node(kind, artifact_name(kind, path), str(path), None, runs, set())


def _node(kind, name, path, fingerprint, runs, seen) -> LineageNode:
    found = producer_of(name, runs, fingerprint)
    if found is None:
        return LineageNode(kind, name, path, None, False)
    run, art = found
    node = LineageNode(kind, name, path, run,
                       fingerprint is None or art["metadata"].get("fingerprint") == fingerprint)
    if run.id in seen:
        return node
    for item in run.used:
        node.inputs.append(_node(item["kind"], item["name"], item["path"], item["fingerprint"], runs,
                                 seen | {run.id}))
    return node


def format_lineage(node: LineageNode, depth: int = 0) -> str:
    made = (f"made by {node.run.job_type} run {node.run.id[:8]} ({node.run.name})" if node.run
            else "not made by a tracked step")
    stale = "" if node.exact or node.run is None else "  [a different version was read]"
    lines = [f"{'  ' * depth}{node.kind}: {node.path}  <- {made}{stale}"]
    lines += [format_lineage(child, depth + 1) for child in node.inputs]
    return "\n".join(lines)


def overview(runs: list[OfflineRun]) -> str:
    """One line per job type: how many runs, artifacts made and media logged."""
    by_type: dict[str, list[OfflineRun]] = {}
    for run in runs:
        by_type.setdefault(run.job_type, []).append(run)
    lines = []
    for job, group in sorted(by_type.items()):
        made = sum(len(r.made) for r in group)
        media = sum(len(r.media) for r in group)
        plots = sum(len(r.plots) for r in group)
        failed = sum(1 for r in group if r.exit_code not in (0, None))
        lines.append(f"{job:16s} {len(group):4d} runs  {made:4d} artifacts  {media:3d} media  "
                     f"{plots:3d} plots" + (f"  {failed} failed" if failed else ""))
    return "\n".join(lines)
