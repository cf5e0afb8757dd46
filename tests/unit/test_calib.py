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
