"""The batch-scores benchmark's variants are valid palu_decode launches that compute the right
thing (through the Triton interpreter on CPU, SmolLM2's real head shapes at a tiny length); its
settings are checked before any GPU work."""
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from palu_bench import batch_scores  # noqa: E402
from palu_bench.cases import palu_case  # noqa: E402
from palu_bench.latency_tuning import tune_params  # noqa: E402
from palu_kernels.palu_decode import palu_decode  # noqa: E402
from palu_kernels.reference import latent_decode_reference  # noqa: E402


@pytest.mark.parametrize("label, s, kept, bits", batch_scores.CONFIGS)
def test_every_variant_matches_the_reference(label, s, kept, bits):
    q, hk, hv, kw, c = palu_case(batch_scores.SHAPE, 2, 48, s, kept, kept, bits, True, device="cpu")
    kw["lengths"] = torch.tensor([48, 29])
    ref = latent_decode_reference(q, hk, hv, **kw)
    for v in batch_scores.VARIANTS:
        out = palu_decode(q, hk, hv, splits=2, **kw, **tune_params(v))
        err = ((out - ref).norm() / ref.norm()).item()
        assert err < 5e-3, (label, v, err)


def test_settings_are_checked():
    assert batch_scores._args(["batches=8,16", "length=1024"]) == ([8, 16], 1024, batch_scores.CFG["rep_ms"])
    with pytest.raises(SystemExit, match="unknown settings"):
        batch_scores._args(["batch=8"])
    with pytest.raises(SystemExit, match="must be >= 1"):
        batch_scores._args(["batches=0"])


def test_prefill_variants_compute_one_attention():
    # the three prefill calls (causal GQA, causal over repeated heads, a padding mask) agree on
    # the rows without padding (the math backend: what a CPU runs)
    calls, counts, real = batch_scores.prefill_variants(3, 40, "cpu", backends=("math",))
    outs = {name: call() for name, call in calls.items()}
    ref = outs["math-causal-gqa"]
    assert set(outs) == {"math-causal-gqa", "math-causal-repeated", "math-mask-repeated"}
    for name, out in outs.items():
        assert torch.allclose(out[1:], ref[1:], atol=1e-5), name
    # row 0's real queries see only real keys under the mask: not what causal attention gives
    assert not torch.allclose(outs["math-mask-repeated"][0, :, 5:], ref[0, :, 5:], atol=1e-3)
    assert counts["flops"] == 4 * 3 * 9 * 40 * 40 * 64 // 2
