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


def test_random_weights_take_a_named_shape_or_a_config_folder(tmp_path):
    from transformers import LlamaConfig

    from palu_bench.random_subject import SHAPES, random_config, random_subject
    assert random_config("random:smollm2-135m").num_hidden_layers == SHAPES["smollm2-135m"]["num_hidden_layers"]
    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=100).save_pretrained(tmp_path)
    model, tok, ids = random_subject(f"random:{tmp_path}", 50, dtype="float32", device="cpu")
    assert model.config.num_hidden_layers == 2 and len(ids) == 50 and 0 < min(ids) and max(ids) < 100
    assert model.generation_config.eos_token_id is None and tok.decode([3, 4]) == "3 4"
    with pytest.raises(SystemExit, match="neither a named shape"):
        random_config(f"random:{tmp_path / 'absent'}")
    args = overrides(["model=random:smollm2-135m"])            # no text= needed
    assert args["text"] is None
    with pytest.raises(SystemExit, match=r"text= is required \(or model=random:NAME\)"):
        overrides(["model=m.gguf"])
