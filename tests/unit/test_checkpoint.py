import copy

import pytest
import torch

import palu
from palu.decompose.checkpoint import CheckpointError, load_compressed
from tiny import tiny_llama


def _make(tmp_path):
    base = tiny_llama(0)
    model = copy.deepcopy(base)
    calib = torch.randint(0, 97, (2, 32))
    result = palu.compress(model, calib, kept_ratio=0.5, group_size=2, multiple=8, progress=False,
                           model_id="tiny-llama")
    path = tmp_path / "ckpt"
    result.save(path)
    return base, model, path


def test_round_trip_reproduces_the_compressed_model_bit_for_bit(tmp_path):
    """Issue 20.8: the in-memory model was fused from float64 factors, a reload from the saved
    float32 ones (6e-5 apart); both are now built from the stored values."""
    base, model, path = _make(tmp_path)
    fresh = copy.deepcopy(base)
    manifest = load_compressed(fresh, path)
    ids = torch.randint(0, 97, (2, 12))
    assert torch.equal(fresh(ids).logits, model(ids).logits)
    assert manifest["allocation"]["group_size"] == 2
    assert manifest["source"]["model_id"] == "tiny-llama"


def test_wrong_base_model_is_refused(tmp_path):
    _, _, path = _make(tmp_path)
    with pytest.raises(CheckpointError, match="was made from 'tiny-llama'"):
        load_compressed(tiny_llama(seed=1), path)


def test_same_size_corruption_of_the_factors_is_refused(tmp_path):
    """Issue 20.5: bytes changed in place (the file still parses, the size is the same) used to
    load, evaluate to NaN and overwrite a good result; the manifest's sha256 now refuses it."""
    base, _, path = _make(tmp_path)
    factors = path / "factors.safetensors"
    data = bytearray(factors.read_bytes())
    data[-64:] = b"\xff" * 64   # the last tensor's bytes: NaN-like floats, same length
    factors.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="is corrupt: sha256"):
        load_compressed(copy.deepcopy(base), path)


def test_corrupt_checkpoint_is_refused(tmp_path):
    base, _, path = _make(tmp_path)
    (path / "factors.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="is corrupt"):
        load_compressed(copy.deepcopy(base), path)
    (path / "factors.safetensors").unlink()
    with pytest.raises(CheckpointError, match="is missing"):
        load_compressed(copy.deepcopy(base), path)
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_compressed(copy.deepcopy(base), path)
    with pytest.raises(CheckpointError, match="not a Palu checkpoint"):
        load_compressed(copy.deepcopy(base), tmp_path / "nowhere")


def test_interrupted_save_leaves_no_checkpoint(tmp_path, monkeypatch):
    from palu.decompose import checkpoint as ck
    base = tiny_llama(0)
    result = palu.compress(copy.deepcopy(base), torch.randint(0, 97, (2, 32)), kept_ratio=0.5,
                           progress=False)

    def boom(*a, **k):
        raise RuntimeError("disk full")
    monkeypatch.setattr(ck, "write_json", boom)
    with pytest.raises(RuntimeError):
        result.save(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
    assert list(tmp_path.iterdir()) == []
