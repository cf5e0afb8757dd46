"""The long-grid cost benchmark (palu_bench.long_throughput) runs end to end on the CPU at a tiny
size and writes its rows: every method asked for, at every length, with the bytes its cache held."""
import json

from palu_bench.long_throughput import main


def test_long_throughput_writes_a_row_per_method_and_length(tmp_path):
    out = tmp_path / "lt.json"
    main([str(out), "lengths=[48,64]", "new_tokens=2", "prompts=1", "processes=[]",
          "methods=[fp16,snapkv,quest]"])
    d = json.loads(out.read_text())
    assert [(r["method"], r["length"]) for r in d["rows"]] == [
        (m, t) for m in ("fp16", "snapkv", "quest") for t in (48, 64)]
    assert all(r["s_per_prompt"] > 0 for r in d["rows"])
    assert d["rows"][0]["bytes"] is None                              # the plain model has no cache
    snap = [r for r in d["rows"] if r["method"] == "snapkv"]
    assert all(r["bytes"]["stored"] > 0 and r["bytes"]["tokens"] == r["length"] - 1 for r in snap)
    assert d["scaling"] == [] and not (tmp_path / "lt.json.tmp").exists()
