"""GPU results -> tables and figures (runs anywhere, from the committed JSON files), and the GPU
benchmarks' early, clear failures on a machine without a GPU or with a bad configuration."""
import copy
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import ROOT
from palu_bench import decode_e2e
from palu_bench.cli.table import decode_outputs, latency_outputs

LATENCY = sorted(str(p) for p in (ROOT / "results" / "latency").glob("h200-llama*.json"))
DECODE = sorted(str(p) for p in (ROOT / "results" / "decode").glob("*.json"))
DECODE_CONF = yaml.safe_load((Path(decode_e2e.__file__).parent / "conf" / "bench" / "decode.yaml").read_text())


@pytest.mark.skipif(not LATENCY, reason="no committed latency results")
def test_latency_table_and_figure_from_committed_runs(tmp_path):
    (tmp_path / "tables").mkdir()
    latency_outputs(LATENCY, str(tmp_path / "tables" / "latency"),
                    str(tmp_path / "figures" / "latency_speedup.png"))
    md = (tmp_path / "tables" / "latency.md").read_text()
    assert re.search(r"\| llama2-7b +\| sdpa +\|", md) and "palu-norope-uniform-g4-int4" in md
    assert (tmp_path / "figures" / "latency_speedup.png").stat().st_size > 10_000


def test_a_configuration_timed_twice_keeps_the_newest_run(tmp_path):
    from palu.artifacts import write_json
    from palu_bench.report.latency import latency_frame

    def run(created, us, variants):
        return {"device": "H200", "created": created, "ceilings": {},
                "rows": [{"variant": v, "shape": "s", "batch": 1, "length": 64, "seconds": us * 1e-6}
                         for v in variants] + [{"variant": "tune", "shape": "s", "batch": 1, "length": 64}]}
    old, new = tmp_path / "a-grid.json", tmp_path / "b-retimed.json"
    write_json(new, run("2026-12-02T10:00:00Z", 30.0, ["palu-x"]))
    write_json(old, run("2026-11-30T10:00:00Z", 40.0, ["palu-x", "sdpa"]))
    frame = latency_frame([str(old), str(new)])   # name order puts the older run first
    us = dict(zip(frame["variant"], frame["seconds"] * 1e6))
    assert us == pytest.approx({"palu-x": 30.0, "sdpa": 40.0})   # the re-timed row wins, the rest stays


@pytest.mark.skipif(not DECODE, reason="no committed decode results")
def test_decode_table_and_memory_figure_from_committed_runs(tmp_path):
    (tmp_path / "tables").mkdir()
    decode_outputs(DECODE, str(tmp_path / "tables" / "decode"),
                   str(tmp_path / "figures" / "memory_vs_context.png"))
    md = (tmp_path / "tables" / "decode.md").read_text()
    for section in ("ms per token", "Peak GPU memory", "Speed-up", "random fp16"):
        assert section in md
    assert (tmp_path / "figures" / "memory_vs_context.png").stat().st_size > 10_000


def test_decode_table_has_the_transformers_section_when_the_run_has_one():
    from palu_bench.report.decode_e2e import hf_markdown
    rows = [{"variant": v, "context": t, "seconds_per_token": ms / 1e3, "seconds_min": ms / 2e3,
             "cache_bytes": 2 ** 30, "speedup": sp}
            for v, ms, sp in (("hf-fp16-static", 48.0, 1.0), ("hf-palu50-g4-int4", 60.0, 0.8)) for t in (4096, 65536)]
    rows.append({"variant": "hf-palu50-g4-fp16", "context": 4096, "error": "out of memory"})
    md = hf_markdown({"rows": rows, "checks": [{"variant": "hf-palu50-g4-int4", "bits": 4, "context": 512,
                                                "rel_err": 8e-3, "kernel_layers": 32}],
                      "baseline": "hf-fp16-static"})
    assert "(eager, no CUDA graph)" in md and re.search(r"\| hf-palu50-g4-int4 +\| +60\.00 +\|", md)
    assert re.search(r"\| hf-palu50-g4-int4 \(vs hf-fp16-static\) +\| +0\.80 +\|", md)
    assert "out of memory" in md and "8.00e-03" in md
    # graph rows name their own baseline
    rows += [{"variant": v, "context": 4096, "seconds_per_token": ms / 1e3, "seconds_min": ms / 1e3,
              "cache_bytes": 2 ** 30, "speedup": sp, "graph": True, "baseline": "hf-fp16-static-graph"}
             for v, ms, sp in (("hf-fp16-static-graph", 6.0, 1.0), ("hf-palu50-g4-int4-graph", 8.0, 0.75))]
    md = hf_markdown({"rows": rows, "checks": [], "baseline": "hf-fp16-static"})
    assert "replayed as CUDA graphs" in md and "palu.GraphDecoder" in md
    assert re.search(r"\| hf-palu50-g4-int4-graph \(vs hf-fp16-static-graph\) +\| +0\.75 +\|", md)
    assert re.search(r"\| hf-palu50-g4-int4 \(vs hf-fp16-static\) +\| +0\.80 +\|", md)   # older rows kept


@pytest.mark.parametrize("change, message", [
    (lambda c: c["variants"].append(dict(c["variants"][0])), "variant names must be unique"),
    (lambda c: c["variants"][1].update(baseline="nope"), "baseline 'nope' is not one of"),
    (lambda c: c["variants"][1]["palu"].update(group_size=3), "group_size=3 does not divide kv_heads=32"),
    (lambda c: c["variants"][1]["palu"].update(kept_k=1.5), "kept_k=1.5 must be in"),
    (lambda c: c["shape"].update(heads=30), "heads=30 is not a multiple of kv_heads=32"),
    (lambda c: c["hf"].update(baseline="nope"), "hf.baseline 'nope' is not one of the variants"),
    (lambda c: c["hf"]["variants"][1].update(cache="paged"), "cache 'paged' is not one of"),
])
def test_decode_benchmark_rejects_bad_configs_before_gpu_work(change, message):
    cfg = copy.deepcopy(DECODE_CONF)
    change(cfg)
    with pytest.raises(ValueError, match=message):
        decode_e2e.run(cfg)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_decode_entry_point_without_gpu_fails_clearly(tmp_path):
    out = tmp_path / "decode.json"
    proc = subprocess.run([sys.executable, "-m", "palu_bench.cli.decode_e2e", f"out={out}"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode != 0
    assert "needs a CUDA GPU" in proc.stdout + proc.stderr
    assert not out.exists()


def test_tune_rows_take_their_own_variants_or_the_shared_list():
    from palu_bench.latency_tuning import tune_plan
    row = {"shape": "s", "length": 4096, "group": 1, "kept": [0.5, 0.5], "bits": 4, "rope": False}
    other = {**row, "shape": "t"}    # another shape's row: timed by that shape's run
    cfg = {"shapes": {"s": {}}, "tune": [row, other, {**row, "variants": [{"qproj_int": True}]}],
           "tune_variants": [{}, {"splits": 8}]}
    (a, va), (b, vb) = tune_plan(cfg)
    assert a == b == row and va == [{}, {"splits": 8}] and vb == [{"qproj_int": True}]
    assert tune_plan({"shapes": {"s": {}}, "tune": [row]}) == [(row, [{}])]


def test_a_shape_with_its_own_lengths_is_timed_only_within_its_context():
    # Qwen2.5-Coder-1.5B has 32K positions: its latency rows stop there, the batched point too
    import yaml
    from palu_bench.latency import CONF, shape_points, shape_selection_lengths
    cfg = yaml.safe_load(CONF.read_text())
    qwen, llama = cfg["shapes"]["qwen25-coder-1.5b"], cfg["shapes"]["llama2-7b"]
    assert shape_points(llama, cfg) == [(1, T) for T in cfg["lengths"]] + [(8, 16384)]
    assert shape_points(qwen, cfg) == [(1, 4096), (1, 8192), (1, 16384), (1, 32768), (8, 16384)]
    assert shape_points({**qwen, "lengths": [4096]}, cfg) == [(1, 4096)]   # 16K batch beyond it
    assert shape_selection_lengths(llama, cfg) == cfg["selection"]["lengths"]
    assert shape_selection_lengths(qwen, cfg) == [32768]
    assert shape_selection_lengths({**qwen, "selection_lengths": [16384, 32768], "lengths": [4096, 16384]},
                                   cfg) == [16384]
    with pytest.raises(ValueError, match="lengths must be positive"):
        shape_points({**qwen, "lengths": [0]}, cfg)


def test_the_best_palu_time_of_a_point_skips_baselines_tune_and_failed_rows():
    # a failed tune variant's row once had no batch and crashed the run after every timing
    from palu_bench.latency import best_palu_seconds
    at = {"shape": "s", "batch": 1, "length": 4096}
    rows = [{"variant": "sdpa", **at, "seconds": 1e-5},
            {"variant": "tune", "shape": "s", "length": 4096, "error": "MLIR pass failed"},
            {"variant": "tune", **at, "seconds": 2e-5},
            {"variant": "palu-rope-uniform-g1-fp16", **at, "error": "too large"},
            {"variant": "palu-rope-uniform-g1-fp16", **at, "seconds": 4e-5},
            {"variant": "palu-rope-uniform-g4-fp16", **at, "seconds": 3e-5},
            {"variant": "palu-rope-uniform-g4-fp16", **{**at, "batch": 8}, "seconds": 1e-6},
            {"variant": "palu-rope-uniform-g4-fp16", **{**at, "length": 8192}, "seconds": 1e-6}]
    assert best_palu_seconds(rows, "s", 1, 4096) == 3e-5
    assert math.isnan(best_palu_seconds(rows, "t", 1, 4096))


def test_tune_variants_take_the_two_pass_shorthand_or_palu_decode_keywords():
    from palu_bench.latency_tuning import tune_params
    assert tune_params([32, [2, 3], [4, 4], 64]) == dict(block_t=32, stages=(2, 3), warps=(4, 4), block_r=64)
    assert tune_params({"fused_int_keys": True, "fused_maxnreg": 128, "splits": 64}) == \
        dict(fused_int_keys=True, fused_maxnreg=128, splits=64)
    with pytest.raises(ValueError, match=r"tune variant \[32, 64\] is neither"):
        tune_params([32, 64])


@pytest.mark.skipif(not LATENCY, reason="no committed latency results")
def test_the_gpu_table_step_logs_its_table_figure_and_plots_to_wandb(tmp_path):
    from omegaconf import OmegaConf

    from palu.pipeline.tracking import read_runs
    from palu_bench.cli.table import run
    cfg = OmegaConf.create({"table": "latency", "inputs": LATENCY, "out": str(tmp_path / "latency"),
                            "figure": str(tmp_path / "latency_speedup.png"),
                            "tracking": {"mode": "offline", "project": "palu-test", "entity": None,
                                         "dir": str(tmp_path / "wandb"), "upload": "small"}})
    run(cfg)
    (wb,) = read_runs(tmp_path / "wandb")
    assert (wb.job_type, wb.name, wb.group, wb.exit_code) == ("collect", "tables/latency", "gpu-benchmarks", 0)
    assert wb.media["tables/latency"] == "table-file" and wb.media["figures/latency_speedup"] == "image-file"
    assert any(k.startswith("latency/speedup_vs_context/") for k in wb.plots)
    assert [u["kind"] for u in wb.used] == ["benchmark"] * len(LATENCY)
    assert {a["type"] for a in wb.made} >= {"table", "figure"}


SCALE = sorted(str(p) for p in (ROOT / "results" / "scale").glob("*.json"))


@pytest.mark.skipif(not SCALE, reason="no committed paper-scale results")
def test_scale_table_projects_the_paper_grid_from_its_dag(tmp_path):
    """Every measured step per shape, and the paper grid's GPU-hours per step kind from its own
    DAG (a dry run): every model step of the grid is priced, the hours add up to the total."""
    from palu_bench.cli.table import scale_outputs
    from palu_bench.report.scale import _newest_per_shape, projection, scale_frame
    scale_outputs(SCALE, str(tmp_path / "scale"), str(tmp_path / "hours.png"), str(ROOT / "conf/grid/paper.yaml"))
    md = (tmp_path / "scale.md").read_text()
    assert "## llama2-7b" in md and "## llama3-8b" in md and "| longcontext kvquant-b3" in md
    runs = _newest_per_shape(SCALE)
    proj, notes = projection(scale_frame(SCALE), str(ROOT / "conf/grid/paper.yaml"), "llama2-7b",
                             runs["llama2-7b"]["shapes"]["llama2-7b"]["config"])
    assert {"calibrate", "fisher", "ranks_probed", "decompose", "evaluate", "zeroshot", "longcontext"} <= set(proj["step"])
    assert (proj["gpu_hours"] > 0).all() and proj.loc[proj["step"] == "evaluate", "jobs"].item() > 100
    total = re.search(r"Total: ([\d.]+) GPU-hours", md).group(1)
    assert float(total) == pytest.approx(proj["gpu_hours"].sum(), abs=0.05)
    assert (tmp_path / "hours.png").stat().st_size > 10_000


def test_scale_method_labels():
    from palu_bench.report.scale import method_label
    assert method_label("palu-whitened-fisher-k0.5-g4-b3/wikitext2-n256-L2048-s0-float16/fisher-n32-L2048-s1-m16") == "palu-b3"
    assert method_label("palu-whitened-uniform-k0.7-g32/x/y") == "palu-b16"
    assert method_label("kivi-b2-g32-r128") == "kivi-b2" and method_label("fp16") == "fp16"
    assert method_label("kvquant-b3-fisher-o0.01/wikitext2-n16") == "kvquant-b3"
