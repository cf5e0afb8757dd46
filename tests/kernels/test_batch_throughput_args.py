"""The throughput benchmark's settings are checked before any model loads."""
import pytest

from palu_bench.batch_throughput import DEFAULTS, overrides


def test_budget_methods_must_be_measured_methods():
    base = ["model=m.gguf", "text=t.txt"]
    args = overrides(base + ["methods=[fp16,palu50-b4-graph]", "budget_methods=[fp16,palu50-b4-graph]"])
    assert args["budget_methods"] == ["fp16", "palu50-b4-graph"]
    with pytest.raises(SystemExit, match=r"budget_methods \['palu50-b4-graph'\] are not among methods"):
        overrides(base + ["budget_methods=[fp16,palu50-b4-graph]"])
    with pytest.raises(SystemExit, match="not among"):
        overrides(base + ["methods=[fp16,nonsense]"])
    with pytest.raises(SystemExit, match="model= is required"):
        overrides(["text=t.txt"])
    assert set(DEFAULTS["budget_methods"]) <= set(DEFAULTS["methods"])
