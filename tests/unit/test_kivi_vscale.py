"""KIVI with calibrated per-channel value scales (the second fitted method, issue 52 item 2): alpha
0 is KIVI exactly; the scales even out a group's channels, so a value with an outlier channel is
coded with less error; the stored scales are counted in the cache's bytes; a state of another
model, an edited manifest or a bad alpha is refused by name. (Decode equivalence, bytes by
formula and generate() run with the other baselines: test_kv_baselines.py; padded batches:
test_padded_batches.py.)"""
import copy
import json

import pytest
import torch

from palu.calib.kvquant import capture_activations
from palu.calib.value_scales import fit_kivi_vscale, fit_value_scales
from palu.methods import MethodError, build_method
from palu.methods.kivi_vscale import ScaledCodec, ValueScales
from palu.quant.codecs import UniformCodec
from tiny import tiny_llama

CALIB = torch.randint(1, 97, (2, 24), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def base():
    return tiny_llama(0).double()


@pytest.fixture(scope="module")
def captured(base):
    return capture_activations(copy.deepcopy(base), CALIB, fisher=False, tokens_per_window=16, progress=False)


def _logits(base, conf, ids):
    method = build_method(conf)
    model = copy.deepcopy(base)
    method.install(model)
    with torch.no_grad():
        return model(ids, past_key_values=method.make_cache(model), use_cache=True).logits, method


def test_alpha_zero_is_kivi_exactly(base, captured):
    state = fit_value_scales(captured, alpha=0.0)
    assert torch.equal(state.scales, torch.ones_like(state.scales))
    ids = torch.randint(1, 97, (2, 30), generator=torch.Generator().manual_seed(1))
    kivi, _ = _logits(base, {"name": "kivi", "bits": 2, "group": 4, "residual": 8}, ids)
    scaled, method = _logits(base, {"name": "kivi_vscale", "bits": 2, "group": 4, "residual": 8, "state": state}, ids)
    assert torch.equal(kivi, scaled)
    assert method.tag == "kivi-b2-g4-r8-vscale-a0"


def test_the_scales_are_fitted_per_channel_with_geometric_mean_one(captured):
    state = fit_value_scales(captured, alpha=0.5)
    L, H, d = state.scales.shape
    assert (L, H) == (captured.info["layers"], captured.acts[(0, "v")].shape[1])
    assert torch.allclose(state.scales.double().log().mean(-1), torch.zeros(L, H, dtype=torch.float64), atol=2e-3)
    peak = captured.acts[(0, "v")].double().abs().amax(0)
    # the largest channel gets the largest scale (alpha > 0), and the scales are fp16 values
    assert torch.equal(state.scales[0].argmax(-1), peak.argmax(-1))
    assert torch.equal(state.scales, state.scales.half().float())


def test_an_outlier_channel_costs_less_with_the_scales():
    """One channel 20x the others in every group: scaling it down before the per-token min-max
    code spends the levels on the other channels, so the decoded values are closer."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 64, 16, generator=g, dtype=torch.float64)
    x[..., 3] *= 20
    peak = x.abs().amax(2)[0]                                           # (H, d): "calibration"
    s = peak.sqrt() / peak.sqrt().log().mean(-1, keepdim=True).exp()
    plain, scaled = UniformCodec(2, 8, "channel"), ScaledCodec(UniformCodec(2, 8, "channel"), s[None])
    err_plain = (plain.decode(plain.encode(x, 0), 0, torch.float64) - x).square().mean()
    err_scaled = (scaled.decode(scaled.encode(x, 0), 0, torch.float64) - x).square().mean()
    assert err_scaled < 0.8 * err_plain, (err_scaled, err_plain)
    assert scaled.layer_metadata_nbytes(0) == 2 * 2 * 16                # fp16 scales of 2 heads x 16 channels


def test_the_state_round_trips_and_is_refused_when_edited_or_of_another_model(base, tmp_path):
    state = fit_kivi_vscale(copy.deepcopy(base), CALIB, alpha=0.5, tokens_per_window=16, progress=False)
    state.save(tmp_path / "s")
    loaded = ValueScales.load(tmp_path / "s")
    assert torch.equal(loaded.scales, state.scales) and loaded.alpha == 0.5 and loaded.tag == "vscale-a0.5"
    conf = {"name": "kivi_vscale", "bits": 2, "group": 4, "residual": 8, "state": str(tmp_path / "s")}
    other = tiny_llama(1).double()
    with pytest.raises(ValueError, match="KIVI value-scale state"):
        build_method(conf).install(other)
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    manifest["alpha"] = 0.25
    (tmp_path / "s" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="manifest"):
        ValueScales.load(tmp_path / "s")
    with pytest.raises(FileNotFoundError, match="fit one with python -m palu.pipeline.cli.fit fitted=kivi_vscale"):
        ValueScales.load(tmp_path / "nothing")


def test_bad_settings_are_refused_by_name(captured):
    with pytest.raises(MethodError, match="kivi_vscale alpha=1.5 is not in"):
        fit_value_scales(captured, alpha=1.5)
    with pytest.raises(MethodError, match="method=kivi_vscale needs method.state"):
        build_method({"name": "kivi_vscale"})
