"""W&B tracking: offline runs written by the steps and read back (config, summary, artifacts,
lineage), reruns that replace their run, disabled tracking that writes nothing, bad settings
that fail before any work. The pipeline test reads back a run of every step of the small grid."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

from conftest import ROOT
from palu.pipeline.tracking import TrackingError, check_tracking, format_lineage, lineage, read_runs, tracked_step
from palu.pipeline.tracking.artifacts import alias_of, artifact_name, fingerprint
from palu.pipeline.tracking.offline import run_folders
from palu.pipeline.tracking.plots import native_plots
from palu.pipeline.tracking.sync import plan
from tiny import save_tiny, tiny_llama, tiny_tokenizer


def _tracking(folder, mode="offline", upload="small"):
    return SimpleNamespace(mode=mode, project="palu-test", entity=None, dir=str(folder), upload=upload)


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_artifact_names_are_valid_stable_and_short(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rel = Path("work/ranks/m/uniform-k0.5-g1-m8.json")
    assert artifact_name("ranks", rel) == artifact_name("ranks", tmp_path / rel) \
        == "ranks-work.ranks.m.uniform-k0.5-g1-m8.json"
    long = Path("results/runs/" + "/".join(["palu-whitened-uniform-k0.7-g3-rot_hadamard-s0-b4"] * 4))
    name = artifact_name("metrics", long)
    assert len(name) <= 128 and re.fullmatch(r"[A-Za-z0-9_.-]+", name)
    assert name == artifact_name("metrics", long) != artifact_name("metrics", long.with_name("other"))
    with pytest.raises(ValueError, match="kind 'weights'"):
        artifact_name("weights", rel)


def test_a_fingerprint_follows_the_bytes_not_the_modification_time(tmp_path):
    small = _write(tmp_path / "a.json", '{"x": 1}')
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(9 << 20))           # over the whole-file limit: sampled blocks
    folder = tmp_path / "ckpt"
    _write(folder / "manifest.json", "{}")
    _write(folder / ".snakemake_timestamp", "")   # Snakemake's marker is not content
    before = {p: fingerprint(p) for p in (small, big, folder)}
    for p in (small, big, folder / "manifest.json"):
        os.utime(p, (1, 1))                        # Snakemake touches outputs after each job
    assert {p: fingerprint(p) for p in (small, big, folder)} == before
    small.write_text('{"x": 2}')
    with big.open("r+b") as fh:
        fh.write(b"\0" * 16)
    _write(folder / "factors.bin", "w")
    assert all(fingerprint(p) != before[p] for p in (small, big, folder))


def _three_steps(folder, upload="small"):
    """prepare-like A makes a, B reads a and makes b, C reads b and makes c (offline)."""
    t = _tracking(folder / "wandb", upload=upload)
    a, b, c = folder / "a" / "weights.bin", folder / "b.json", folder / "c.json"
    a.parent.mkdir(parents=True)
    a.write_bytes(os.urandom(2 << 20))             # over 1 MiB: by reference under `small`
    with tracked_step(t, {"step": "A", "seed": 3}, "calibrate", "a", "m") as wb:
        wb.make("gram", a.parent)
    with tracked_step(t, {"step": "B"}, "ranks", "b", "m", used={"gram": str(a.parent)}) as wb:
        _write(b, "{}")
        wb.metrics({"kept_ratio_realised": 0.5, "flag": True, "label": "x"})
        wb.make("ranks", b)
    with tracked_step(t, {"step": "C"}, "evaluate", "c", "m", used={"ranks": [str(b)]}) as wb:
        _write(c, '{"ppl": 12.5}')
        wb.metrics({"ppl": 12.5})
        wb.make("metrics", c)
    return t, a, b, c


def test_offline_runs_read_back_with_config_summary_artifacts_and_lineage(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    t, a, b, c = _three_steps(tmp_path)
    runs = read_runs(t.dir)
    assert [r.job_type for r in runs] == ["calibrate", "ranks", "evaluate"]
    A, B, C = runs
    assert {r.group for r in runs} == {"m"} and [r.name for r in runs] == ["a", "b", "c"]
    assert all(r.exit_code == 0 for r in runs)
    assert A.config["seed"] == 3 and A.used == []
    assert B.used == [{"kind": "gram", "name": artifact_name("gram", a.parent), "path": str(a.parent),
                       "fingerprint": fingerprint(a.parent)}]
    assert B.summary["kept_ratio_realised"] == 0.5 and "flag" not in B.summary
    assert C.summary["ppl"] == 12.5 and C.summary["lineage/made"] == [artifact_name("metrics", c)]
    gram = A.made[0]
    assert gram["type"] == "gram" and gram["files"] == ["weights.bin"]
    assert gram["references"] == [a.resolve().as_uri()]          # large: not uploaded
    assert alias_of(fingerprint(a.parent)) in gram["aliases"]
    assert B.made[0]["references"] == []                          # small: uploaded
    tree = lineage(c, runs)
    assert (tree.kind, tree.run.id, tree.exact) == ("metrics", C.id, True)
    (ranks,) = tree.inputs
    assert (ranks.kind, ranks.run.id, ranks.exact) == ("ranks", B.id, True)
    (calib,) = ranks.inputs
    assert (calib.kind, calib.run.id, calib.exact, calib.inputs) == ("gram", A.id, True, [])
    text = format_lineage(tree)
    assert text.index("metrics:") < text.index("ranks:") < text.index("gram:") and "different" not in text
    # what a sync would declare: each input at the exact version read
    todo, _ = plan(t.dir)
    assert todo.uses == {B.id: [f"{artifact_name('gram', a.parent)}:{alias_of(fingerprint(a.parent))}"],
                         C.id: [f"{artifact_name('ranks', b)}:{alias_of(fingerprint(b))}"]}


def test_lineage_says_when_a_different_version_was_read(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    t, a, b, c = _three_steps(tmp_path)
    b.write_text('{"changed": 1}')                 # remade outside any tracked step
    with tracked_step(t, {}, "evaluate", "c", "m", used={"ranks": str(b)}) as wb:
        wb.make("metrics", c)
    tree = lineage(c, read_runs(t.dir))
    assert tree.inputs[0].run is not None and not tree.inputs[0].exact
    assert "[a different version was read]" in format_lineage(tree)


def test_a_rerun_replaces_its_offline_run_and_upload_none_uploads_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    t = _tracking(tmp_path / "wandb", upload="none")
    out = _write(tmp_path / "r.json", "{}")
    for _ in range(2):
        with tracked_step(t, {}, "ranks", "same-tag", "m") as wb:
            wb.make("ranks", out)
    with tracked_step(t, {}, "ranks", "other-tag", "m"):
        pass
    runs = read_runs(t.dir)
    assert sorted(r.name for r in runs) == ["other-tag", "same-tag"]
    assert [r for r in runs if r.name == "same-tag"][0].made[0]["references"] == [out.resolve().as_uri()]


def test_disabled_tracking_writes_nothing_and_a_failed_step_is_marked(tmp_path):
    off = _tracking(tmp_path / "nothing", mode="disabled")
    with tracked_step(off, {}, "ranks", "x", "m", used={"ranks": "does/not/exist"}) as wb:
        assert not wb.enabled
        wb.metrics({"a": 1.0})
        wb.make("ranks", "does/not/exist")
    assert not (tmp_path / "nothing").exists()
    t = _tracking(tmp_path / "wandb")
    with pytest.raises(RuntimeError, match="boom"):
        with tracked_step(t, {}, "decompose", "x", "m") as wb:
            raise RuntimeError("boom")
    (run,) = read_runs(t.dir)
    assert run.exit_code == 1 and run.made == []


def test_bad_tracking_settings_fail_before_any_work(tmp_path):
    blocker = _write(tmp_path / "a-file", "")
    for bad, match in [(_tracking(tmp_path, mode="sometimes"), "tracking.mode='sometimes'"),
                       (_tracking(tmp_path, upload="maybe"), "tracking.upload='maybe'"),
                       (_tracking(blocker / "wandb"), "cannot be written")]:
        with pytest.raises(TrackingError, match=match):
            check_tracking(bad)
    out = tmp_path / "ranks.json"
    for override, message in [("tracking.mode=sometimes", "tracking.mode='sometimes'"),
                              (f"tracking.dir={blocker}/wandb", "cannot be written")]:
        proc = subprocess.run([sys.executable, "-m", "palu.pipeline.cli.ranks", f"paths.work={tmp_path}",
                               override, f"out={out}"], capture_output=True, text=True, cwd=ROOT)
        assert proc.returncode != 0 and message in proc.stderr + proc.stdout
        assert not out.exists()


def test_the_prepare_step_logs_the_model_folder_by_reference(tmp_path):
    src = save_tiny(tiny_llama(0), tiny_tokenizer(), tmp_path / "tiny")
    out, wandb_dir = tmp_path / "work" / "models" / "tiny", tmp_path / "work" / "wandb"
    proc = subprocess.run([sys.executable, "-m", "palu.pipeline.cli.prepare", f"model.id={src}", "model.name=tiny",
                           f"paths.work={tmp_path / 'work'}", "tracking.upload=none", f"out={out}"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (run,) = read_runs(wandb_dir)
    assert (run.job_type, run.name, run.group) == ("prepare", "work/models/tiny", "tiny")
    assert run.config["model"]["id"] == str(src) and run.config["lineage"] == {"used": []}
    (art,) = run.made
    assert art["type"] == "model" and "config.json" in art["files"]
    assert all(ref.startswith("file://") for ref in art["references"]) and len(art["references"]) == len(art["files"])
    assert art["metadata"]["fingerprint"] == fingerprint(out)


def test_native_plots_of_the_committed_tables():
    plots = native_plots("granularity", pd.read_csv(ROOT / "results/tables/granularity.csv"))
    assert {"granularity/ppl_vs_kept_ratio/wiki_standin", "granularity/ppl_vs_kept_ratio/novels_standin"} <= set(plots)
    quant = native_plots("quantization", pd.read_csv(ROOT / "results/tables/quantization.csv"))
    assert "quantization/ppl_vs_bits/wiki_standin" in quant and "quantization/ppl_vs_bits_by_family/wiki_standin" in quant
    latency = ROOT / "results/tables/latency.csv"
    if latency.is_file():
        assert any(k.startswith("latency/speedup_vs_context/") for k in native_plots("latency", pd.read_csv(latency)))
    assert native_plots("baseline", pd.read_csv(ROOT / "results/tables/baseline.csv")) == {}


def test_the_lineage_command_lists_runs_and_names_a_missing_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    t, a, b, c = _three_steps(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    show = subprocess.run([sys.executable, "-m", "palu.pipeline.cli.lineage", f"tracking.dir={t.dir}", f"target={c}"],
                          capture_output=True, text=True, env=env)
    assert show.returncode == 0, show.stderr[-2000:]
    assert "made by evaluate run" in show.stdout and "made by calibrate run" in show.stdout
    empty = subprocess.run([sys.executable, "-m", "palu.pipeline.cli.lineage", f"tracking.dir={tmp_path / 'none'}"],
                           capture_output=True, text=True, env=env)
    assert empty.returncode != 0 and "no offline W&B runs" in empty.stderr + empty.stdout
    assert len(run_folders(t.dir)) == 3


def test_lineage_of_a_tables_markdown_and_of_a_result_no_step_made(tmp_path, monkeypatch):
    """A table's .md is written beside its .csv by one collect step: its lineage is the CSV's. A
    result no tracked step made is named with how to record it; a run folder a killed step left
    without a log is skipped, not a crash."""
    monkeypatch.chdir(tmp_path)
    t, a, b, c = _three_steps(tmp_path)
    table = tmp_path / "tables" / "baseline.csv"
    table.parent.mkdir()
    with tracked_step(t, {}, "collect", "tables/baseline", "m", used={"metrics": [str(c)]}) as wb:
        _write(table, "ppl\n12.5\n")
        table.with_suffix(".md").write_text("| ppl |")
        wb.make("table", table)
    tree = lineage(table.with_suffix(".md"), read_runs(t.dir))
    assert (tree.kind, tree.path, tree.inputs[0].kind) == ("table", str(table), "metrics")
    with pytest.raises(ValueError, match=r"no tracked step made .*rerun its step here"):
        lineage(tmp_path / "a" / "weights.bin", read_runs(t.dir))
    (Path(t.dir) / "wandb" / "offline-run-20260101_000000-deadbeef" / "files").mkdir(parents=True)
    assert len(read_runs(t.dir)) == 4


def test_a_run_is_named_by_where_its_output_lies():
    """Results by their path in the results folder; anything in the work folder (a checkpoint, or
    a result run by hand under work/results/) with `work/` first, so it never reads as committed."""
    from types import SimpleNamespace

    from palu.pipeline.cli.common import run_name_of
    cfg = SimpleNamespace(paths=SimpleNamespace(results="results", work="work"))
    assert run_name_of(cfg, "results/runs/m/fp16/ppl-x.json") == "runs/m/fp16/ppl-x"
    assert run_name_of(cfg, "work/results/runs/m/fp16/ppl-x.json") == "work/results/runs/m/fp16/ppl-x"
    assert run_name_of(cfg, "work/palu/m/c/palu-whitened-uniform-k0.5-g3-m8") == "work/palu/m/c/palu-whitened-uniform-k0.5-g3-m8"
    assert run_name_of(cfg, "/elsewhere/out.json") == "out.json"


def test_a_tracked_step_leaves_the_environment_as_it_found_it(tmp_path):
    """W&B's folders and its service socket do not outlive the step in os.environ: a process that
    runs steps and then launches others (Snakemake from a test or a notebook) must not hand its
    children this step's folders or a socket to its own service."""
    before = dict(os.environ)
    t = _tracking(tmp_path / "wandb")
    for name in ("x", "y"):
        with tracked_step(t, {"a": 1}, "calibrate", name, "m") as wb:
            wb.metrics({"v": 1.0})
    assert {k for k in set(os.environ) | set(before) if os.environ.get(k) != before.get(k)} == set()
    assert [r.name for r in read_runs(t.dir)] == ["x", "y"]


def test_a_run_records_its_own_command_line_not_the_sweeps(tmp_path):
    """One job of a Hydra multirun passes its own overrides (`job_args`): W&B's environment record
    then holds `method.bits=2`, not the whole sweep's `method.bits=2,4`."""
    t = _tracking(tmp_path / "wandb")
    argv = list(sys.argv)
    with tracked_step(t, {"a": 1}, "evaluate", "one", "m", args=["method=kivi", "method.bits=2"]):
        pass
    with tracked_step(t, {"a": 1}, "evaluate", "two", "m"):
        pass
    assert sys.argv == argv
    one, two = read_runs(t.dir)
    assert one.args == ["method=kivi", "method.bits=2"] and two.args == argv[1:]
