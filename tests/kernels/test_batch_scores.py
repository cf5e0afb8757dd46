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
