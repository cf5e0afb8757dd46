"""Artifacts whose metadata lies (issue 34, item 3): every artifact's metadata is sealed with it,
names the model it was made from, and what the tables report is derived from what is installed.

- a Palu manifest edited to another kept ratio, tag or group size: refused (sealed); re-sealed by
  hand with a group size its factors do not have: refused by the factors' shapes;
- a KVQuant state whose manifest says 2 bits for a 3-bit codebook, or another outlier fraction:
  refused (sealed; re-sealed: refused by the codebooks' sizes); a state fitted on another model of
  the same shapes: refused at install;
- a rank file edited to full ranks: refused (sealed; re-sealed: its ranks and its recorded kept
  ratio disagree); Gram / Fisher statistics of another model: refused by its steps."""
import copy
import json

import pytest
import torch

import palu
from palu.calib.stats_file import StatisticsMismatchError, check_model, load_stats, save_stats
from palu.decompose.checkpoint import CheckpointError
from palu.decompose.ranks import allocate, check_allocation
from palu.artifacts import IntegrityError, read_json, seal, unseal, write_json
from palu.methods import build_method
from palu.calib.kvquant import fit_kvquant
from palu.models.adapters import geometry_of
from tiny import tiny_llama

CALIB = torch.randint(0, 97, (3, 32), generator=torch.Generator().manual_seed(3))


@pytest.fixture()
def checkpoint(tmp_path):
    palu.compress(tiny_llama(0), CALIB, kept_ratio=0.5, group_size=1, progress=False).save(tmp_path / "c")
    return tmp_path / "c"


def _edit(path, change, reseal=False):
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(seal(unseal_unchecked(record)) if reseal else record))


def unseal_unchecked(record):
    return {k: v for k, v in record.items() if k != "integrity"}


@pytest.mark.parametrize("field, value", [("tag", "palu-whitened-uniform-k0.7-g1"),
                                          ("summary.kept_ratio_target", 0.7),
                                          ("allocation.group_size", 2)])
def test_an_edited_palu_manifest_is_refused(checkpoint, field, value):
    def change(m):
        *path, leaf = field.split(".")
        node = m
        for p in path:
            node = node[p]
        node[leaf] = value
    _edit(checkpoint / "manifest.json", change)
    with pytest.raises(CheckpointError, match="edited after it was written"):
        build_method({"name": "palu", "checkpoint": str(checkpoint)}).tag
    with pytest.raises(CheckpointError, match="edited after it was written"):
        palu.load_compressed(tiny_llama(0), checkpoint)


def test_a_resealed_manifest_whose_group_size_its_factors_lack_is_refused(checkpoint):
    """Was a matmul shape error deep in attention (issue 34, item 4)."""
    def change(m):
        m["allocation"]["group_size"] = 2
        for r in m["allocation"]["ranks"]:
            r["group"] //= 2
    _edit(checkpoint / "manifest.json", change, reseal=True)
    with pytest.raises(CheckpointError, match=r"listed twice|factors A .* group size 2"):
        palu.load_compressed(tiny_llama(0), checkpoint)


def test_reported_kept_ratio_and_group_size_come_from_the_installed_factors(checkpoint):
    method = build_method({"name": "palu", "checkpoint": str(checkpoint)})
    method.install(tiny_llama(0))
    model = tiny_llama(0)
    m = palu.load_compressed(model, checkpoint)
    ranks = sum(layer.self_attn.ranks_k[0] + layer.self_attn.ranks_v[0] for layer in model.model.layers)
    geom = geometry_of(tiny_llama(0).config)
    assert method.summary()["kept_ratio_realised"] == pytest.approx(
        ranks * geom.num_kv_heads / (geom.num_layers * geom.kv_size()))
    assert m["installed"]["group_size"] == method.summary()["group_size"] == 1


@pytest.fixture()
def kvquant_state(tmp_path):
    fit_kvquant(tiny_llama(0).double(), CALIB, bits=3, weighting="uniform", tokens_per_window=16,
                progress=False).save(tmp_path / "s")
    return tmp_path / "s"


@pytest.mark.parametrize("field, value, message", [("bits", 2, "2-bit state has 4"),
                                                   ("outlier_fraction", 0.2, "outliers per vector")])
def test_a_kvquant_state_whose_manifest_lies_is_refused(kvquant_state, field, value, message):
    def change(m):
        m[field] = value
    _edit(kvquant_state / "manifest.json", change)
    with pytest.raises(IntegrityError, match="edited after it was written"):
        build_method({"name": "kvquant", "state": str(kvquant_state)}).tag
    _edit(kvquant_state / "manifest.json", lambda m: None, reseal=True)   # a hand-made seal
    with pytest.raises(ValueError, match=message):
        build_method({"name": "kvquant", "state": str(kvquant_state)}).tag


def test_a_kvquant_state_of_another_model_is_refused(kvquant_state):
    same_shapes = tiny_llama(1).double()
    with pytest.raises(StatisticsMismatchError, match="another model"):
        build_method({"name": "kvquant", "state": str(kvquant_state)}).install(same_shapes)
    build_method({"name": "kvquant", "state": str(kvquant_state)}).install(tiny_llama(0).double())


def test_a_rank_file_edited_to_full_ranks_is_refused(tmp_path):
    geom = geometry_of(tiny_llama(0).config)
    allocation = allocate(geom, 0.5, 1, "uniform", 8)
    path = tmp_path / "ranks.json"
    write_json(path, seal(allocation))

    def full(a):
        for r in a["ranks"]:
            r["rank"] = r["full"]
    _edit(path, full)
    with pytest.raises(IntegrityError, match="edited after it was written"):
        unseal(read_json(path), "rank file")
    _edit(path, lambda a: None, reseal=True)
    with pytest.raises(ValueError, match="keep 1.000000 of the K/V dimensions, but it records kept_ratio_realised 0.5"):
        check_allocation(unseal(read_json(path), "rank file"), geom)


@pytest.mark.parametrize("rank, message", [(7.5, "rank 7.5"), (0, "rank 0"), (True, "rank True")])
def test_bad_ranks_are_named(rank, message):
    """Were a TypeError / KeyError (issue 34, item 4)."""
    geom = geometry_of(tiny_llama(0).config)
    allocation = allocate(geom, 0.5, 1, "uniform", 8)
    allocation["ranks"][3]["rank"] = rank
    with pytest.raises(ValueError, match=message):
        check_allocation(allocation, geom)
    allocation = allocate(geom, 0.5, 1, "uniform", 8)
    del allocation["ranks"][2]
    with pytest.raises(ValueError, match=r"blocks \[\(0, 'v', 0\)\] missing"):
        check_allocation(allocation, geom)
    with pytest.raises(ValueError, match="missing"):
        palu.decompose.factors.decompose_model(tiny_llama(0), allocation, None, "plain", progress=False)


def test_statistics_name_their_model(tmp_path):
    model, other = tiny_llama(0), tiny_llama(1)
    save_stats(tmp_path / "g.safetensors", {"gram": torch.eye(3)}, {"tokens": 5}, model)
    tensors, meta = load_stats(tmp_path / "g.safetensors", "Gram")
    assert torch.equal(tensors["gram"], torch.eye(3)) and meta["tokens"] == 5
    check_model(meta, model.config, meta["model"]["hash"])
    from palu.decompose.checkpoint import source_hash
    with pytest.raises(StatisticsMismatchError, match="another model"):
        check_model(meta, other.config, source_hash(other))
    with pytest.raises(StatisticsMismatchError, match="other shapes"):
        check_model(meta, tiny_llama(0, kv_heads=4).config)


@pytest.mark.parametrize("tag", ["../../../escaped", "a/b", ".hidden", "$(touch x)", "two words"])
def test_a_resealed_manifest_whose_tag_is_a_path_is_refused_as_a_name(checkpoint, tmp_path, tag):
    """Issue 51, item 6: the seal is an unkeyed sha256, so a manifest can be edited and resealed;
    its tag becomes a path component of every result and is checked as an untrusted name."""
    from palu.pipeline import naming
    _edit(checkpoint / "manifest.json", lambda m: m.update(tag=tag), reseal=True)
    method = build_method({"name": "palu", "checkpoint": str(checkpoint)})
    with pytest.raises(naming.UnsafeNameError, match="method tag"):
        naming.run_name(method.tag, method.lineage())
    with pytest.raises(naming.UnsafeNameError):
        naming.metrics_path(str(tmp_path / "results"), "m", naming.run_name(method.tag), "wiki", 64, None)
    assert naming.run_name("palu-whitened-uniform-k0.5-g1-b4", ("c-wiki_standin-n24",)) == \
        "palu-whitened-uniform-k0.5-g1-b4/c-wiki_standin-n24"


def test_a_save_never_deletes_a_folder_of_other_files(tmp_path):
    """Issue 51, item 8: a Palu checkpoint or a KVQuant state saved into a folder holding the
    user's files is refused (the files stay); over an artifact of its kind, or into an empty
    folder, it is saved."""
    result = palu.compress(tiny_llama(0), CALIB, kept_ratio=0.5, group_size=1, progress=False)
    state = fit_kvquant(tiny_llama(0), CALIB, bits=3, weighting="uniform", tokens_per_window=16, progress=False)
    for save, name in ((result.save, "ckpt"), (state.save, "state")):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "thesis.tex").write_text("years of work")
        with pytest.raises(FileExistsError, match=r"thesis.tex.*would delete them"):
            save(folder)
        assert (folder / "thesis.tex").read_text() == "years of work"
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []   # no leftovers
        (folder / "thesis.tex").unlink()
        save(folder)                                  # empty: saved
        save(folder)                                  # its own kind: replaced
        assert (folder / "manifest.json").is_file()
    build_method({"name": "palu", "checkpoint": str(tmp_path / "ckpt")}).tag


def test_non_finite_factors_and_statistics_are_refused_at_save_and_load(tmp_path, checkpoint):
    """Issue 51, item 9: a NaN / inf factor would install and make every logit after it
    non-finite; statistics' tensor bytes are sealed with their metadata."""
    from safetensors.torch import load_file, save_file
    from palu.artifacts import IntegrityError, sha256_file
    # a factor edited to NaN, its manifest resealed with the new file's sha256: refused at install
    tensors = load_file(str(checkpoint / "factors.safetensors"))
    name = sorted(tensors)[0]
    tensors[name][0, 0] = float("nan")
    save_file(tensors, str(checkpoint / "factors.safetensors"))
    _edit(checkpoint / "manifest.json",
          lambda m: m["files"].update({"factors.safetensors": sha256_file(checkpoint / "factors.safetensors")}),
          reseal=True)
    with pytest.raises(CheckpointError, match=r"non-finite"):
        palu.load_compressed(tiny_llama(0), checkpoint)
    # a result holding a non-finite factor is not saved
    result = palu.compress(tiny_llama(0), CALIB, kept_ratio=0.5, group_size=1, progress=False)
    result.factors[0].B_v[0][0, 0] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        result.save(tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    # grams with inf: named before any linear algebra
    from palu.calib.gram import collect_grams
    g = collect_grams(tiny_llama(0), CALIB, progress=False)["gram"]
    g[1, 0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"grams\[1\].*non-finite"):
        palu.compress(tiny_llama(0), None, kept_ratio=0.5, group_size=1, grams=g, progress=False)
    # statistics: NaN refused at save; tensor bytes changed under intact metadata refused at load
    model = tiny_llama(0)
    with pytest.raises(ValueError, match="non-finite"):
        save_stats(tmp_path / "nan.safetensors", {"gram": torch.full((2, 2), float("nan"))}, {}, model)
    save_stats(tmp_path / "g.safetensors", {"gram": torch.eye(3)}, {"tokens": 5}, model)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "g.safetensors"), "pt") as f:
        meta = f.metadata()
    save_file({"gram": 2 * torch.eye(3)}, str(tmp_path / "g.safetensors"), metadata=meta)
    with pytest.raises(IntegrityError, match="tensors were changed"):
        load_stats(tmp_path / "g.safetensors", "Gram")


def test_the_source_hash_is_the_one_by_one_digest_of_float32_bytes():
    """`sha256_in_order` overlaps copies with hashing: the digest must stay the sequential one
    (checkpoints made before record it), for any dtype, a transposed view and no tensor at all."""
    import hashlib

    from palu.decompose.checkpoint import sha256_in_order
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(33, 17, generator=g).half(), torch.randn(8, 5, generator=g).bfloat16(),
               torch.randn(6, 9, generator=g).t(), torch.randn(3, generator=g, dtype=torch.float64)]
    want = hashlib.sha256()
    for w in weights:
        want.update(w.float().contiguous().numpy().tobytes())
    assert sha256_in_order(weights) == want.hexdigest()
    assert sha256_in_order(weights[::-1]) != want.hexdigest()
    assert sha256_in_order([]) == hashlib.sha256().hexdigest()
