"""Calibration statistics: the same on a GPU as on the CPU (the grid's `device: cuda` runs them
there), and returned on the CPU either way."""
import pytest
import torch

from palu.calib.fisher import collect_fisher
from palu.calib.gram import collect_grams
from tiny import tiny_llama


def _stats(device):
    model = tiny_llama(0).double().to(device)
    windows = torch.randint(0, 97, (3, 24), generator=torch.Generator().manual_seed(0))
    return collect_grams(model, windows, progress=False), collect_fisher(model, windows, progress=False)


def test_statistics_come_back_on_the_cpu_as_float64():
    gram, fisher = _stats("cpu")
    assert gram["gram"].device.type == fisher["fisher"].device.type == "cpu"
    assert gram["gram"].dtype == fisher["fisher"].dtype == torch.float64
    assert gram["tokens"] == 72 and fisher["windows"] == 3
    assert (fisher["fisher"] > 0).all()


@pytest.mark.gpu
def test_gpu_statistics_equal_cpu_statistics():
    (g_cpu, f_cpu), (g_gpu, f_gpu) = _stats("cpu"), _stats("cuda")
    assert g_gpu["gram"].device.type == "cpu"
    # transformers' RMSNorm computes in float32 even in a float64 model, so CPU and GPU agree to
    # float32 rounding (Gram entries are ~70 here; measured differences up to 6e-6)
    torch.testing.assert_close(g_gpu["gram"], g_cpu["gram"], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(f_gpu["fisher"], f_cpu["fisher"], rtol=1e-4, atol=0)


def test_rms_fisher_is_the_mean_per_weight_rms_gradient():
    """The official Palu code's scoring: sqrt(mean over windows of grad^2) per weight, averaged
    over the head's weights; checked against per-window gradients taken here."""
    model = tiny_llama(0).double()
    windows = torch.randint(0, 97, (3, 24), generator=torch.Generator().manual_seed(0))
    stats = collect_fisher(model, windows, progress=False)
    k = model.model.layers[1].self_attn.k_proj.weight
    squares = torch.zeros_like(k)
    for w in windows:
        model.zero_grad()
        model(input_ids=w[None], labels=w[None]).loss.backward()
        squares += model.model.layers[1].self_attn.k_proj.weight.grad.detach() ** 2
    model.zero_grad()
    rms = (squares / 3).sqrt().view(2, 16, -1).mean(dim=(1, 2))
    assert torch.allclose(stats["rms_fisher"][1, 0], rms, rtol=1e-10)
    assert torch.allclose(stats["fisher"][1, 0], squares.view(2, 16, -1).sum(dim=(1, 2)), rtol=1e-10)


def test_fisher_of_a_float16_model_does_not_underflow():
    """float16 gradients flush below 6e-8: unscaled, every Fisher entry of this model (gradients
    ~1e-7) came out 0. With loss scaling the float16 statistics follow the float32 ones to the
    model's own float16 error."""
    import palu.calib.fisher as fisher
    model = tiny_llama(0)
    with torch.no_grad():
        model.lm_head.weight.mul_(1e-5)
    windows = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(0))
    reference = collect_fisher(model, windows, progress=False)
    half = collect_fisher(model.half(), windows, progress=False)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()
    for key in ("fisher", "output_fisher", "rms_fisher"):
        assert rel(half[key], reference[key]) < 0.05, key
    assert (half["fisher"] > 0).all()


def test_an_overflowing_scaled_backward_halves_its_scale():
    from palu.calib.fisher import scaled_backward
    p = torch.ones(3, dtype=torch.float16, requires_grad=True)
    resets = []

    def reset():
        p.grad = None
        resets.append(1)
    scale = scaled_backward(lambda: (p * 1000).sum(), lambda: [p.grad], 2.0 ** 16, reset)
    assert 1000 * scale <= 65504 and torch.isfinite(p.grad).all() and resets
    assert p.grad[0].item() == 1000 * scale
