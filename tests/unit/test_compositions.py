"""Compositions of token eviction with compressed caches (issue 36): KIVI + SnapKV and Palu +
SnapKV, each against its parts on tiny float64 models — with the compression exact (KIVI's
residual holding every token; Palu at full rank) the composition decodes exactly as SnapKV alone;
with it real it holds the bytes of the kept tokens only (as the compressed method's own formula
counts them), a poisoned evicted token changes nothing, and the compression changes the answer."""
import copy

import pytest
import torch

from palu.methods import MethodError, build_method
from tiny import tiny_llama

TOL = 1e-9
T, NEW = 24, 6
SNAP = {"compression_ratio": 0.5, "window": 4, "kernel": 3}
EVICT = {"evict_ratio": 0.5, "evict_window": 4, "evict_kernel": 3}


def _run(base, conf, ids):
    method = build_method(dict(conf))
    model = copy.deepcopy(base)
    method.install(model)
    cache = method.make_cache(model)
    with torch.no_grad():
        prefill = model(ids[:, :T], past_key_values=cache, use_cache=True).logits
        steps = torch.cat([model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits
                           for t in range(T, T + NEW)], 1)
    return method, cache, prefill, steps


@pytest.fixture(scope="module")
def one_layer():
    """One layer, one KV head: the evicted set is the same per head and per layer, so SnapKV alone
    is the exact reference of either composition."""
    base = tiny_llama(0, kv_heads=1, layers=1).double()
    ids = torch.randint(0, 97, (1, T + NEW), generator=torch.Generator().manual_seed(3))
    snap = _run(base, {"name": "snapkv", **SNAP}, ids)
    return base, ids, snap


def test_kivi_snapkv_with_every_token_exact_is_snapkv(one_layer):
    base, ids, (_, _, snap_pre, snap_steps) = one_layer
    method, cache, pre, steps = _run(base, {"name": "kivi_snapkv", "bits": 2, "group": 4, "residual": 64,
                                            **EVICT}, ids)
    assert (pre - snap_pre).abs().max().item() < TOL and (steps - snap_steps).abs().max().item() < TOL
    assert cache.get_seq_length() == T + NEW and cache.layers[0].held() == [T // 2 + NEW]
    assert method.tag == "kivi-b2-g4-r64-snapkv-r0.5-w4-k3"


def test_kivi_snapkv_stores_the_kept_tokens_as_kivi_and_reads_no_evicted_one(one_layer):
    base, ids, (_, _, _, snap_steps) = one_layer
    conf = {"name": "kivi_snapkv", "bits": 2, "group": 4, "residual": 4, **EVICT}
    method, cache, _, steps = _run(base, conf, ids)
    kept = T // 2 + NEW
    assert method.cache_nbytes(cache) == method.expected_nbytes(kept, element_size=8)
    full = build_method({"name": "kivi", "bits": 2, "group": 4, "residual": 4})
    full.install(copy.deepcopy(base))
    assert method.cache_nbytes(cache)["total"] < full.expected_nbytes(T + NEW, element_size=8)["total"]
    assert (steps - snap_steps).abs().max().item() > 1e-3          # 2-bit codes change the answer
    # an evicted prompt token, poisoned, changes nothing after the prefill's choice (one layer:
    # a kept token's key and value are its own embedding's). The vote (on exact keys, as SnapKV
    # alone's) spans every token, so poisoning one may move the choice: those tokens are skipped.
    pos = _snapkv_kept(base, ids)
    same = 0
    for dropped in [j for j in range(T) if j not in pos]:
        poisoned = ids.clone()
        poisoned[0, dropped] = (poisoned[0, dropped] + 1) % 97
        if _snapkv_kept(base, poisoned) == pos:
            same += 1
            _, _, _, steps2 = _run(base, conf, poisoned)
            assert (steps2 - steps).abs().max().item() < TOL
    assert same >= 1


def _snapkv_kept(base, ids) -> list[int]:
    snap = build_method({"name": "snapkv", **SNAP})
    model = copy.deepcopy(base)
    snap.install(model)
    c = snap.make_cache(model)
    with torch.no_grad():
        model(ids[:, :T], past_key_values=c, use_cache=True)
    return c.layers[0].positions[0, 0].tolist()


@pytest.mark.parametrize("conf, match", [
    ({"name": "kivi_snapkv", "evict_ratio": 1.0}, "evict_ratio"),
    ({"name": "kivi_snapkv", "evict_kernel": 2}, "evict_kernel"),
    ({"name": "kivi_snapkv", "evict_window": 0}, "evict_window"),
])
def test_bad_composition_settings_are_refused(conf, match):
    with pytest.raises(MethodError, match=match):
        build_method(conf)


def test_one_pass_scores_through_a_composition_are_refused():
    from palu.methods.base import check_one_pass
    with pytest.raises(MethodError, match="evicts tokens after the prefill"):
        check_one_pass(build_method({"name": "kivi_snapkv", **EVICT}), "perplexity")


# ---- Palu + SnapKV ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def palu_checkpoints(tmp_path_factory, one_layer):
    """Full-rank and half-rank checkpoints of the one-layer model."""
    import palu
    base, _, _ = one_layer
    out = {}
    for kept in (1.0, 0.5):
        model = copy.deepcopy(base)
        result = palu.compress(model, torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(0)),
                               kept_ratio=kept, group_size=1, multiple=8 if kept < 1 else 1, progress=False)
        path = tmp_path_factory.mktemp(f"k{kept}") / "ckpt"
        result.save(path)
        out[kept] = str(path)
    return out


def test_palu_snapkv_at_full_rank_is_snapkv(one_layer, palu_checkpoints):
    base, ids, (_, _, snap_pre, snap_steps) = one_layer
    method, cache, pre, steps = _run(base, {"name": "palu_snapkv", "checkpoint": palu_checkpoints[1.0],
                                            **EVICT}, ids)
    assert (pre - snap_pre).abs().max().item() < 1e-8 and (steps - snap_steps).abs().max().item() < 1e-8
    layer = cache.layers[0]
    assert cache.get_seq_length() == T + NEW and layer.keys.shape[-2] == T // 2 + NEW
    assert not layer.contiguous and layer.positions[0, -NEW:].tolist() == list(range(T, T + NEW))
    assert method.tag.endswith("-snapkv-r0.5-w4-k3")


def test_palu_snapkv_holds_the_kept_tokens_latents_only_and_reads_no_evicted_one(one_layer, palu_checkpoints):
    base, ids, (_, _, _, snap_steps) = one_layer
    conf = {"name": "palu_snapkv", "checkpoint": palu_checkpoints[0.5], "latent_bits": 4, **EVICT}
    method, cache, _, steps = _run(base, conf, ids)
    alone, alone_cache, _, _ = _run(base, {"name": "palu", "checkpoint": palu_checkpoints[0.5], "latent_bits": 4}, ids)
    kept = T // 2 + NEW
    n, full = method.cache_nbytes(cache), alone.cache_nbytes(alone_cache)
    for key in ("data", "metadata", "total"):     # every stored byte is per token: kept / all of it
        assert n[key] * (T + NEW) == full[key] * kept
    assert (steps - snap_steps).abs().max().item() > 1e-3       # half rank, 4 bits: a different answer
    # (the votes come from the rebuilt keys, so the kept set may differ from SnapKV's on exact keys)
    pos = cache.layers[0].positions[0].tolist()
    assert len(pos) == kept and pos == sorted(pos) and pos[T // 2 - 4:] == list(range(T - 4, T + NEW))
    # a poisoned evicted token changes nothing when the vote keeps the same set (the softmax
    # behind the vote spans every token, so poisoning one may move the choice: those are skipped)
    same = 0
    for dropped in [j for j in range(T) if j not in pos]:
        poisoned = ids.clone()
        poisoned[0, dropped] = (poisoned[0, dropped] + 1) % 97
        _, cache2, _, steps2 = _run(base, conf, poisoned)
        if cache2.layers[0].positions[0].tolist() == pos:
            same += 1
            assert (steps2 - steps).abs().max().item() < TOL
    assert same >= 1


def test_palu_snapkv_generates_as_its_token_by_token_loop_on_a_deeper_gqa_model(tmp_path):
    """Two layers, two KV heads, G-LRD groups of 2: `generate` (transformers' masks over the held
    tokens, positions from the tokens seen) equals feeding its tokens one at a time."""
    import palu
    base = tiny_llama(0, kv_heads=2, layers=2).double()
    model = copy.deepcopy(base)
    palu.compress(model, torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(0)),
                  kept_ratio=0.5, group_size=2, multiple=8, progress=False).save(tmp_path / "c")
    method = build_method({"name": "palu_snapkv", "checkpoint": str(tmp_path / "c"), **EVICT})
    model = copy.deepcopy(base)
    method.install(model)
    ids = torch.randint(0, 97, (1, T), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = model.generate(ids, past_key_values=method.make_cache(model), max_new_tokens=5,
                             do_sample=False, pad_token_id=0)
        cache = method.make_cache(model)
        logits = model(ids, past_key_values=cache, use_cache=True).logits[:, -1]
        tokens = []
        for _ in range(5):
            tokens.append(logits.argmax(-1))
            logits = model(tokens[-1][:, None], past_key_values=cache, use_cache=True).logits[:, -1]
    assert out[0, T:].tolist() == torch.stack(tokens, 1)[0].tolist()
    assert all(layer.keys.shape[-2] == T // 2 + 5 for layer in cache.layers)   # the last token too


def test_palu_snapkv_refuses_padding_anywhere_but_on_the_left(one_layer, palu_checkpoints):
    """A left-padded batch is served row by row (test_padded_batches.py); a row's pads after its
    first token would be voted for and kept: refused by name."""
    base, ids, _ = one_layer
    method = build_method({"name": "palu_snapkv", "checkpoint": palu_checkpoints[0.5], **EVICT})
    model = copy.deepcopy(base)
    method.install(model)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, 3:5] = 0
    with pytest.raises(ValueError, match="serves left-padded batches"), torch.no_grad():
        model(ids[:, :T].expand(2, -1), attention_mask=mask, past_key_values=method.make_cache(model),
              use_cache=True)


@pytest.mark.parametrize("kind", ["default", "linear", "yarn", "llama3", "dynamic"])
def test_palu_snapkv_at_full_rank_is_snapkv_under_each_rope_type(kind, tmp_path):
    """The kept tokens' keys are rotated when read, at the positions they were seen at: under every
    RoPE type a full-rank Palu model supports (beyond the 16 original positions, where the scaled
    types differ) the composition decodes as SnapKV alone; a type whose rotation of a cached key
    changes with the length (dynamic NTK) is refused by name (tests/unit/test_rope_types.py)."""
    import palu
    from palu.models.adapters import UnsupportedRopeError
    from test_rope_types import ROPE
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)    # one KV head: SnapKV's set per head is the composition's set per layer
    base = LlamaForCausalLM(LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=16, rope_scaling=ROPE[kind])).double().eval()
    calib = torch.randint(0, 97, (4, 16), generator=torch.Generator().manual_seed(2))
    ids = torch.randint(0, 97, (1, T + NEW), generator=torch.Generator().manual_seed(3))
    if kind == "dynamic":
        with pytest.raises(UnsupportedRopeError, match="dynamic"):
            palu.compress(copy.deepcopy(base), calib, kept_ratio=1.0, group_size=1, progress=False)
        return
    assert ROPE[kind] is None or ROPE[kind]["rope_type"] == kind
    palu.compress(copy.deepcopy(base), calib, kept_ratio=1.0, group_size=1,
                  progress=False).save(tmp_path / "c")
    _, _, snap_pre, snap_steps = _run(base, {"name": "snapkv", **SNAP}, ids)
    _, cache, pre, steps = _run(base, {"name": "palu_snapkv", "checkpoint": str(tmp_path / "c"), **EVICT}, ids)
    assert (pre - snap_pre).abs().max().item() < 1e-8 and (steps - snap_steps).abs().max().item() < 1e-8
    assert all(layer.keys.shape[-2] == T // 2 + NEW for layer in cache.layers)


def test_palu_tova_at_full_rank_is_tova_and_evicts_every_step(one_layer, palu_checkpoints):
    """The eviction contract (`cache/eviction.py`): TOVA's scorer over Palu's latent storage. At full
    rank with one KV head (its set per head is the composition's set per layer) it decodes exactly
    as TOVA alone, through a prefill over the budget and decode steps that each evict one token;
    the cache holds `budget` tokens' latents, at their own positions."""
    base, ids, _ = one_layer
    budget = 10
    _, tova_cache, tova_pre, tova_steps = _run(base, {"name": "tova", "budget": budget}, ids)
    method, cache, pre, steps = _run(base, {"name": "palu_tova", "checkpoint": palu_checkpoints[1.0],
                                            "budget": budget}, ids)
    assert (pre - tova_pre).abs().max().item() < 1e-8 and (steps - tova_steps).abs().max().item() < 1e-8
    layer = cache.layers[0]
    assert cache.get_seq_length() == T + NEW and layer.keys.shape[-2] == budget
    assert layer.positions[0].tolist() == tova_cache.layers[0].positions[0, 0].tolist()
    assert method.tag.endswith("-tova-n10")
    with torch.no_grad():   # and it really evicts: full attention over every token differs
        full = base(ids, use_cache=False).logits[:, T:]
    assert (steps - full).abs().max().item() > 1e-3


def test_a_stateful_scorer_cannot_share_one_set_per_layer():
    """H2O's accumulated attention is per KV head's tokens: a storage whose heads share one kept
    set (Palu's latents) refuses it by name rather than averaging state it cannot follow."""
    from palu.methods.h2o import H2OPolicy
    policy = H2OPolicy(budget=4, window=1)
    q, k = torch.randn(1, 2, 6, 8), torch.randn(1, 1, 6, 8)
    with pytest.raises(TypeError, match="H2OPolicy keeps state per KV head"):
        policy.keep_shared(0, [(q, k)], 0.5)


def test_bad_palu_tova_settings_are_refused(palu_checkpoints):
    with pytest.raises(MethodError, match="method.budget=0"):
        build_method({"name": "palu_tova", "checkpoint": palu_checkpoints[0.5], "budget": 0})
