"""Latent rotation fused into the factors (issue 16, item 2): orthogonal for every rank, the model
unchanged without quantisation (float64), outliers spread, and a clear error for a bad name."""
import copy

import pytest
import torch

import palu
from palu.decompose.rotation import hadamard, rotation_matrix
from tiny import FAMILIES

TOL64 = 1e-9


@pytest.mark.parametrize("n", [1, 2, 4, 8, 12, 16, 20, 24, 40, 48, 96, 128, 192])
def test_hadamard_orders_known_here_are_hadamard(n):
    H = hadamard(n)
    assert H is not None and set(H.unique().tolist()) <= {-1.0, 1.0}
    assert torch.equal(H @ H.T, n * torch.eye(n, dtype=torch.float64))


@pytest.mark.parametrize("n", [3, 28, 56, 100])
def test_any_other_rank_gets_a_seeded_orthogonal_matrix(n):
    R, how = rotation_matrix("hadamard", n, seed=4)
    assert how == "random_orthogonal"
    assert (R @ R.T - torch.eye(n, dtype=torch.float64)).abs().max() < 1e-12
    assert torch.equal(R, rotation_matrix("random_orthogonal", n, seed=4)[0])
    assert not torch.equal(R, rotation_matrix("random_orthogonal", n, seed=5)[0])


def test_an_unknown_rotation_is_refused_naming_it():
    with pytest.raises(ValueError, match="rotation='givens' is not one of"):
        rotation_matrix("givens", 8)
    from omegaconf import OmegaConf

    from palu.pipeline.config import ConfigError, validate
    with pytest.raises(ConfigError, match="palu.rotation='givens'"):
        validate(OmegaConf.create({"model": {"name": "m", "id": "x"}, "palu": {"rotation": "givens"}}))


def _compressed(name, rotation, fuse, multiple=8, kept=0.5):
    base = FAMILIES[name](0).double()
    model = copy.deepcopy(base)
    calib = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(0))
    result = palu.compress(model, calib, kept_ratio=kept, group_size=1, multiple=multiple, fuse=fuse,
                           rotation=rotation, progress=False)
    return model, result


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("rotation", ["hadamard", "random_orthogonal"])
def test_a_rotated_model_gives_the_unrotated_logits(name, fuse, rotation):
    """B'A' = B R Rᵀ A = B A, and the fused o_proj / q_proj follow from B': float64 < 1e-9. Rank
    multiple 4 gives ranks (12, 20, 28, ...) with and without a Hadamard order."""
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(1))
    plain, _ = _compressed(name, "none", fuse, multiple=4, kept=0.6)
    rotated, result = _compressed(name, rotation, fuse, multiple=4, kept=0.6)
    assert (rotated(ids, use_cache=False).logits - plain(ids, use_cache=False).logits).abs().max().item() < TOL64
    blocks = result.report["rotation"]["blocks"]
    assert sum(blocks.values()) == 2 * len(result.factors) * len(result.factors[0].A_k)
    assert result.manifest["tag"].endswith(f"-rot_{rotation}-s0")


def test_the_rotation_spreads_a_latent_outlier_and_changes_a_quantised_cache():
    """What the rotation is for: a per-token quantiser sees no single dominant channel."""
    R, how = rotation_matrix("hadamard", 16)
    h = torch.randn(1000, 16, dtype=torch.float64)
    h[:, 3] *= 30                                  # one outlier channel
    peak = lambda x: (x.abs().max(-1).values / x.abs().mean(-1)).mean()  # noqa: E731
    assert how == "hadamard" and peak(h @ R) < peak(h) / 2
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(2))
    plain, _ = _compressed("llama", "none", True)
    rotated, _ = _compressed("llama", "hadamard", True)
    a = plain(ids, past_key_values=palu.LatentCache(plain, bits=2)).logits
    b = rotated(ids, past_key_values=palu.LatentCache(rotated, bits=2)).logits
    assert (a - b).abs().max().item() > 1e-6


def test_a_rotated_checkpoint_round_trips(tmp_path):
    model, result = _compressed("qwen2", "hadamard", True)
    result.save(tmp_path / "ckpt")
    fresh = FAMILIES["qwen2"](0).double()
    manifest = palu.load_compressed(fresh, tmp_path / "ckpt")
    assert manifest["summary"]["rotation"] == "hadamard"
    ids = torch.randint(0, 97, (1, 10))
    assert torch.equal(fresh(ids).logits, model(ids).logits)
