"""LoRA recovery: the deltas start at zero, training lowers the distillation loss, the merged
factors are an ordinary checkpoint of the same ranks that reloads to the same model."""
import copy

import pytest
import torch
import torch.nn.functional as F

import palu
from palu.decompose.checkpoint import save_compressed
from palu.recover import LoraRecovery, factors_of, recover
from tiny import tiny_llama, tiny_opt


def _kl(student, teacher, windows):
    with torch.no_grad():
        total = 0.0
        for w in windows:
            t = F.log_softmax(teacher(w[None]).logits, -1)
            s = F.log_softmax(student(w[None]).logits, -1)
            total += F.kl_div(s, t, log_target=True, reduction="batchmean").item() / w.numel()
    return total / len(windows)


@pytest.mark.parametrize("make", [tiny_llama, tiny_opt])
def test_recovery_lowers_the_distillation_loss_and_reloads(make, tmp_path):
    base = make(0).double()
    calib = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(0))
    model = copy.deepcopy(base)
    result = palu.compress(model, calib, kept_ratio=0.3, group_size=1, multiple=2, progress=False)
    assert all(torch.equal(a, b) for fa, fb in zip(result.factors, factors_of(model))
               for a, b in zip(fa.A_k + fa.B_v, fb.A_k + fb.B_v))        # round trip, untouched
    before = _kl(model, base, calib)
    flags = [p.requires_grad for p in model.parameters()]
    report = recover(model, base, calib, LoraRecovery(rank=4, steps=40, lr=1e-2), progress=False)
    after = _kl(model, base, calib)
    assert report["kl_last"] < report["kl_first"] and after < 0.8 * before
    # the loss is taken in float32, as in perplexity
    assert report["kl_first"] == pytest.approx(_kl_first(base, result, calib), rel=1e-4, abs=1e-7)
    assert [p.requires_grad for p in model.parameters()] == flags
    recovered = factors_of(model)
    assert [f.ranks_k for f in recovered] == [f.ranks_k for f in result.factors]
    assert all(torch.equal(a, b) for fa, fb in zip(result.factors, recovered) for a, b in zip(fa.B_k, fb.B_k))
    save_compressed(tmp_path / "rec", recovered, {**result.manifest, "recovery": report})
    reloaded = copy.deepcopy(base)
    palu.load_compressed(reloaded, tmp_path / "rec")
    ids = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, model(ids).logits, atol=1e-10)


def _kl_first(base, result, calib):
    """The first step's loss is the untouched compressed model's on window 0 (the deltas start at 0)."""
    fresh = copy.deepcopy(base)
    palu.install_palu(fresh, result.factors, result.allocation["group_size"])
    return _kl(fresh, base, calib[:1])


def test_recovery_needs_palu_attention_and_sane_settings():
    base = tiny_llama(0)
    with pytest.raises(ValueError, match="Palu attention"):
        recover(base, base, torch.zeros(1, 8, dtype=torch.long), progress=False)
    for bad in ({"rank": 0}, {"steps": -1}, {"lr": 0.0}, {"rank": 2.5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            LoraRecovery(**bad).check()
