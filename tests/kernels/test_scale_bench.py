"""The paper-scale benchmark (benchmarks/palu_bench/scale.py) end to end on a tiny shape on the
CPU: every step runs through the library functions the pipeline calls and gives a row with no
error; a step that fails is an error row and the steps that need it are skipped, not run."""
import json
from pathlib import Path

import pytest

from palu_bench.scale import load_config, run

TINY = {"hidden_size": 128, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 97, "rope_theta": 10000.0, "max_position_embeddings": 128}


def _tiny_config(tmp_path):
    cfg = load_config()
    cfg.update(shapes={"tiny": TINY}, dtype="float32", device="cpu", scratch=str(tmp_path), seqlen=48,
               gram_windows=2, fisher_windows=1, eval_windows=1, rank_multiple=8,
               group_sizes=[1, "kv_heads"], probe_group_size="kv_heads", palu_group_size="kv_heads",
               kvquant={"windows": 1, "tokens_per_window": 8, "bits": 3, "outlier_fraction": 0.01},
               zeroshot={"requests": 2, "length": 12, "batch": 2, "batch_requests": 3},
               eval_batch={"windows": 5, "batch": 3})
    cfg["longcontext"] = {**cfg["longcontext"], "context": 64, "new_tokens": 3, "batch": 2, "batch_context": 40}
    return cfg


def test_every_step_runs_at_a_tiny_shape(tmp_path):
    out = tmp_path / "scale.json"
    result = run(_tiny_config(tmp_path), out=str(out), log=lambda *_: None)
    rows = result["rows"]
    failed = [(r["step"], r["variant"], r["error"]) for r in rows if "error" in r]
    assert not failed, failed
    steps = {r["step"] for r in rows}
    assert {"build", "save", "load", "gram", "fisher", "ranks", "whitened_svds", "decompose",
            "save_checkpoint", "kvquant_capture", "fit_kvquant", "install", "ppl", "zeroshot",
            "longcontext"} <= steps
    methods = {r["variant"] for r in rows if r["step"] == "ppl"}
    assert methods == {"fp16", "palu-b16", "palu-b4", "palu-b3", "palu-b2", "kivi-b4", "kivi-b2",
                       "atom-b4", "turboquant-b3", "kvquant-b3"}
    assert all(r["tokens_per_s"] > 0 for r in rows if "tokens" in r)
    generated = [r for r in rows if r["step"] == "longcontext"]
    assert len(generated) == 6 and all(r["new_tokens"] == 3 for r in generated)
    batched = [r for r in rows if r["step"] == "longcontext_batched"]   # every method, 2 x (40 + 3)
    assert len(batched) == 10 and all(r["tokens"] == 86 and r["cache_bytes_per_prompt"] > 0 for r in batched)
    # perplexity windows 3 a forward, as the evaluate step runs them with data.batch_size
    ppl_b = [r for r in rows if r["step"] == "ppl_batched"]
    assert {r["variant"] for r in ppl_b} == methods and all(r["batch"] == 3 and r["tokens"] == 5 * 48 for r in ppl_b)
    # requests of 12 tokens, 2 a forward: the last batch holds the third alone
    assert all(r["requests"] == 3 and r["batch"] == 2 for r in rows if r["step"] == "zeroshot_batched")
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(rows))
    assert not list(tmp_path.glob("palu-scale-*"))      # the scratch folder is removed


def test_a_failed_step_is_an_error_row_and_its_dependants_are_skipped(tmp_path, monkeypatch):
    import palu.calib.gram as gram
    monkeypatch.setattr(gram, "collect_grams", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    cfg = _tiny_config(tmp_path)
    cfg.update(load=False, methods=[{"name": "fp16"}, {"name": "palu", "latent_bits": 4}])
    cfg["longcontext"]["methods"] = [{"name": "fp16"}]
    rows = run(cfg, log=lambda *_: None)["rows"]
    by = {(r["step"], r["variant"]): r for r in rows}
    assert by[("gram", "")]["error"] == "RuntimeError: boom"
    assert by[("decompose", "g1")]["error"].startswith("skipped: needs gram")
    assert by[("install", "palu-b4")]["error"].startswith("skipped: needs decompose")
    assert "error" not in by[("ppl", "fp16")] and "error" not in by[("longcontext", "fp16")]


def test_bad_settings_fail_before_any_work():
    cfg = load_config()
    with pytest.raises(ValueError, match="llama9"):
        run(cfg, shapes=["llama9"])
    with pytest.raises(ValueError, match="float8"):
        run({**cfg, "dtype": "float8"})


def test_device_checks_run_and_compare_like_with_like():
    """`check_devices` (run against the CPU on the GPU host) compares each moved step; CPU vs CPU
    is the same arithmetic, so every difference is zero."""
    from palu_bench.scale import check_devices
    rows = check_devices("cpu", log=lambda *_: None)
    assert len(rows) == 6 and all(r["rel_diff"] == 0 for r in rows), rows


def test_a_partial_run_measures_its_steps_and_what_they_need(tmp_path):
    """`steps=[...]`: the named measurements, the Gram / checkpoint / KVQuant fit they need, no
    Fisher, probe or other group sizes; unknown step names fail before any work."""
    cfg = _tiny_config(tmp_path)
    cfg.update(load=False, steps=["zeroshot_batched"],
               methods=[{"name": "fp16"}, {"name": "palu", "latent_bits": 4}, {"name": "kvquant", "bits": 3}])
    rows = run(cfg, log=lambda *_: None)["rows"]
    assert not [r for r in rows if "error" in r]
    steps = {(r["step"], r["variant"]) for r in rows}
    assert {("gram", ""), ("decompose", "g2"), ("fit_kvquant", "b3"), ("zeroshot_batched", "palu-b4"),
            ("zeroshot_batched", "kvquant-b3")} <= steps
    assert not {s for s, _ in steps} & {"fisher", "ranks", "whitened_svds", "ppl", "zeroshot", "longcontext"}
    assert ("decompose", "g1") not in steps
    with pytest.raises(ValueError, match="zeroshots"):
        run({**cfg, "steps": ["zeroshots"]})


def test_the_table_takes_each_step_from_its_newest_run(tmp_path):
    """A partial run's rows replace the same (step, variant) of an older full run and keep the rest;
    the projection prices a grid's suite at its batched rate only where the grid batches it."""
    from palu_bench.report.scale import Rates, scale_frame
    base = {"device": "GPU", "shapes": {"s": {"weight_bytes": 2 ** 30}}, "config": {}, "versions": {}}
    old = {**base, "created": "2026-12-01", "rows": [
        {"shape": "s", "step": "zeroshot", "variant": "fp16", "seconds": 2.0, "tokens": 100, "tokens_per_s": 50.0},
        {"shape": "s", "step": "ppl", "variant": "fp16", "seconds": 1.0, "tokens": 100, "tokens_per_s": 100.0}]}
    new = {**base, "created": "2026-12-05", "rows": [
        {"shape": "s", "step": "zeroshot_batched", "variant": "fp16", "seconds": 0.1, "tokens": 100,
         "tokens_per_s": 1000.0},
        {"shape": "s", "step": "ppl", "variant": "fp16", "seconds": 0.5, "tokens": 100, "tokens_per_s": 200.0}]}
    paths = []
    for i, r in enumerate((new, old)):     # the order of the files does not matter, their dates do
        paths.append(str(tmp_path / f"{i}.json"))
        Path(paths[-1]).write_text(json.dumps(r))
    frame = scale_frame(paths)
    by = {(r.step, r.variant): r for r in frame.itertuples()}
    assert len(frame) == 3 and by[("ppl", "fp16")].tokens_per_s == 200.0 and by[("ppl", "fp16")].run == "2026-12-05"
    assert by[("zeroshot", "fp16")].run == "2026-12-01"
    rates = Rates(frame, "s")
    assert rates.suite_rate("zeroshot", "fp16", {"zeroshot": {"batch_size": "auto"}})[0] == 1000.0
    assert rates.suite_rate("zeroshot", "fp16", {"zeroshot": {}})[0] == 50.0
    rates.ok = rates.ok[rates.ok["step"] != "zeroshot_batched"]   # batched grid, nothing batched measured
    assert rates.suite_rate("zeroshot", "fp16", {"zeroshot": {"batch_size": 8}})[0] == 50.0
    assert any("one-at-a-time" in n for n in rates.notes)


def _row(step, variant, seconds, shape="llama2-7b"):
    return {"shape": shape, "step": step, "variant": variant, "seconds": seconds}


def _lines(path, rows):
    """A run's JSON lines, as one stopped at its time limit leaves them."""
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_merge_partial_keeps_the_stopped_runs_rows_and_the_later_runs_metadata(tmp_path):
    # a run stopped at a call's time limit leaves only its JSON lines; the later run of the rest
    # gives the metadata, and its rows come last (the table keeps the newest row of a step)
    from palu.artifacts import read_json, write_json
    from palu_bench.scale import merge_partial
    partial = _lines(tmp_path / "a.json.partial.jsonl", [_row("gram", "", 4.0), _row("install", "fp16", 0.1)])
    complete = tmp_path / "b.json"
    write_json(complete, {"device": "H100", "rows": [_row("gram", "", 3.9)], "shapes": {"llama2-7b": {}},
                          "config": {}, "created": "2026-12-06T15:14:11Z"})
    merged = merge_partial(str(tmp_path / "m.json"), str(partial), str(complete))
    assert [r["seconds"] for r in merged["rows"]] == [4.0, 0.1, 3.9]
    assert read_json(tmp_path / "m.json")["device"] == "H100"
    _lines(partial, [_row("gram", "", 1.0, shape="llama3-8b")])
    with pytest.raises(ValueError, match="llama3-8b"):
        merge_partial(str(tmp_path / "n.json"), str(partial), str(complete))
    assert not (tmp_path / "n.json").exists()


def test_add_steps_appends_only_the_named_steps_and_keeps_earlier_merges(tmp_path):
    from palu.artifacts import write_json
    from palu_bench.scale import add_steps
    partial = _lines(tmp_path / "c.json.partial.jsonl", [_row("gram", "", 4.0), _row("ppl_batched", "fp16", 2.0)])
    into = tmp_path / "b.json"
    write_json(into, {"device": "H100", "rows": [_row("gram", "", 3.9)], "shapes": {"llama2-7b": {}},
                      "merged": {"partial": "a.jsonl"}})
    added = add_steps(str(tmp_path / "m.json"), str(partial), str(into), ["ppl_batched"], "why")
    assert [(r["step"], r["seconds"]) for r in added["rows"]] == [("gram", 3.9), ("ppl_batched", 2.0)]
    assert [m["partial"] for m in added["merged"]] == ["a.jsonl", "c.json.partial.jsonl"]
    for steps, match in ((["gram"], "already"), (["zeroshot"], "no rows")):
        with pytest.raises(ValueError, match=match):
            add_steps(str(tmp_path / "n.json"), str(partial), str(into), steps, "why")
    assert not (tmp_path / "n.json").exists()
