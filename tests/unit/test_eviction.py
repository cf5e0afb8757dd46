"""Token eviction (issue 36, first methods): StreamingLLM and SnapKV through `SubsetKVCache`, each
against a plain reference — the unmodified model with a 4-D mask that hides exactly the evicted
tokens — on tiny float64 models; the cache really holds fewer bytes; bad settings refused."""
import copy

import pytest
import torch

from palu.methods import MethodError, build_method
from palu.eval.perplexity import perplexity
from tiny import FAMILIES, tiny_llama

TOL = 1e-9


def _installed(base, conf):
    method = build_method(dict(conf))
    model = copy.deepcopy(base)
    method.install(model)
    return method, model


@torch.no_grad()
def _stepwise(model, cache, ids):
    return torch.cat([model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits
                      for t in range(ids.shape[1])], 1)


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3"])   # (OPT takes no 4-D mask to compare with)
def test_streaming_llm_equals_the_model_under_its_sink_and_window_mask(family):
    """Query p sees tokens j < sink and p - window < j <= p: a one-pass window, token-by-token
    decoding through the cache and the plain model under that mask agree; between steps the cache
    holds sink + window - 1 tokens (the next query is the window's last), whatever the length."""
    base = FAMILIES[family](0).double()
    method, model = _installed(base, {"name": "streaming_llm", "sink": 2, "window": 5})
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(1))
    T = ids.shape[1]
    q, k = torch.arange(T)[:, None], torch.arange(T)[None]
    band = (k <= q) & ((k < 2) | (q - k < 5))
    with torch.no_grad():
        ref = base(ids, attention_mask=band[None, None], use_cache=False).logits
        one = model(ids, past_key_values=method.make_cache(model), use_cache=True).logits
    cache = method.make_cache(model)
    steps = _stepwise(model, cache, ids)
    assert (one - ref).abs().max().item() < TOL and (steps - ref).abs().max().item() < TOL
    with torch.no_grad():   # and it really differs from full attention
        assert (base(ids, use_cache=False).logits - ref).abs().max().item() > 1e-3
    import palu
    geom = palu.geometry_of(base.config)
    geom_kv, hd = geom.num_kv_heads, geom.head_dim
    n = method.cache_nbytes(cache)
    assert cache.kept_tokens() == 6 and cache.get_seq_length() == T
    assert n["data"] == model.config.num_hidden_layers * 2 * geom_kv * 6 * hd * 8
    assert n["read_per_step"] == n["total"] == n["data"] + n["metadata"]
    ppl = perplexity(model, ids, progress=False, make_cache=lambda: method.make_cache(model))["ppl"]
    assert ppl > 1


def _kept_mask(cache, T):
    """(T,): which prompt tokens layer 0's single KV head kept."""
    pos = cache.layers[0].positions[0, 0].long()
    mask = torch.zeros(T, dtype=torch.bool)
    mask[pos[pos < T]] = True
    return mask


def test_snapkv_keeps_its_budget_and_decodes_as_the_model_masked_to_what_it_kept():
    """One KV head (so every query head shares the choice, which a 4-D mask can express): after
    the prefill each layer holds round(T * (1 - ratio)) tokens, the observation window among
    them; the continuation decoded through the cache equals the plain model with a mask hiding,
    per layer, the evicted prompt tokens (a poisoned evicted token changes nothing)."""
    base = tiny_llama(0, kv_heads=1).double()
    method, model = _installed(base, {"name": "snapkv", "compression_ratio": 0.5, "window": 4, "kernel": 3})
    T, new = 24, 6
    ids = torch.randint(0, 97, (1, T + new), generator=torch.Generator().manual_seed(2))
    cache = method.make_cache(model)
    with torch.no_grad():
        model(ids[:, :T], past_key_values=cache, use_cache=True)
    for layer in range(model.config.num_hidden_layers):
        pos = cache.layers[layer].positions[0, 0]
        assert pos.numel() == 12 and set(range(T - 4, T)) <= set(pos.tolist())
    n = method.cache_nbytes(cache)
    assert n["data"] == model.config.num_hidden_layers * 2 * 1 * 12 * 16 * 8
    steps = _stepwise(model, cache, ids[:, T:])      # (layers keep different tokens: the masked
    assert steps.shape == (1, new, 97)               # reference is the one-layer test below)
    assert all(cache.layers[l].positions.shape[-1] == 12 + new for l in range(model.config.num_hidden_layers))


def test_snapkv_with_one_layer_equals_the_masked_model_and_ignores_poisoned_tokens():
    base = tiny_llama(0, kv_heads=1, layers=1).double()
    method, model = _installed(base, {"name": "snapkv", "compression_ratio": 0.6, "window": 4, "kernel": 3})
    T, new = 24, 6
    ids = torch.randint(0, 97, (1, T + new), generator=torch.Generator().manual_seed(3))
    cache = method.make_cache(model)
    with torch.no_grad():
        prefill = model(ids[:, :T], past_key_values=cache, use_cache=True).logits
    steps = _stepwise(model, cache, ids[:, T:])
    kept = _kept_mask(cache, T)
    assert kept.sum().item() == T - round(T * 0.6)
    full = T + new
    q, k = torch.arange(full)[:, None], torch.arange(full)[None]
    kept_k = torch.cat([kept, torch.ones(new, dtype=torch.bool)])[None]     # every new token stays
    mask = (k <= q) & ((q < T) | kept_k)            # the prefill attends fully, decoding to the kept
    with torch.no_grad():
        ref = base(ids, attention_mask=mask[None, None], use_cache=False).logits
    assert (prefill - ref[:, :T]).abs().max().item() < TOL     # the prefill itself is full attention
    assert (steps - ref[:, T:]).abs().max().item() < TOL
    with torch.no_grad():                                         # eviction changed the answer
        assert (base(ids, use_cache=False).logits[:, T:] - steps).abs().max().item() > 1e-4
    # poison: an evicted token replaced by another changes nothing after the prefill's choice
    dropped = (~kept).nonzero()[0].item()
    poisoned = ids.clone()
    poisoned[0, dropped] = (poisoned[0, dropped] + 1) % 97
    with torch.no_grad():
        ref2 = base(poisoned, attention_mask=mask[None, None], use_cache=False).logits
    # the kept tokens' keys depend on earlier tokens (through the layers below); with one layer
    # a kept token's key is its own embedding's: the decode reads no evicted token
    assert (ref2[:, T:] - steps).abs().max().item() < TOL


def test_one_pass_scores_through_snapkv_are_refused():
    from palu import evaluate_text
    base = tiny_llama(0).double()
    method, model = _installed(base, {"name": "snapkv"})
    with pytest.raises(MethodError, match="evicts tokens after the prefill"):
        evaluate_text(model, windows=torch.randint(0, 97, (1, 16)), method=method, progress=False)


@pytest.mark.parametrize("conf, match", [
    ({"name": "streaming_llm", "window": 0}, "window"),
    ({"name": "streaming_llm", "sink": -1}, "sink"),
    ({"name": "snapkv", "compression_ratio": 1.0}, "compression_ratio"),
    ({"name": "snapkv", "kernel": 4}, "kernel"),
    ({"name": "snapkv", "window": 0}, "window"),
    ({"name": "h2o", "budget": 8, "window": 8}, "window"),
    ({"name": "tova", "budget": 0}, "budget"),
    ({"name": "quest", "page": 4, "budget": 6}, "budget"),
])
def test_bad_eviction_settings_are_refused(conf, match):
    with pytest.raises(MethodError, match=match):
        build_method(conf)


def test_padding_not_on_the_left_and_a_foreign_cache_are_refused():
    """Left padding is served row by row (test_padded_batches.py); pads after a row's first
    token (right padding, holes) would be counted as its tokens: refused."""
    from transformers import DynamicCache
    base = tiny_llama(0).double()
    method, model = _installed(base, {"name": "streaming_llm", "sink": 1, "window": 4})
    ids = torch.randint(0, 97, (2, 6))
    for hidden in (slice(4, 6), slice(2, 3)):
        mask = torch.ones(2, 6, dtype=torch.long)
        mask[1, hidden] = 0
        with pytest.raises(ValueError, match="serves left-padded batches"):
            model(ids, attention_mask=mask, past_key_values=method.make_cache(model), use_cache=True)
    with pytest.raises(TypeError, match="method.make_cache"):
        model(ids, past_key_values=DynamicCache(), use_cache=True)


def test_pyramidkv_budgets_shrink_with_depth_around_snapkvs_mean():
    base = tiny_llama(0, kv_heads=1, layers=3).double()
    method, model = _installed(base, {"name": "pyramidkv", "compression_ratio": 0.5, "window": 2,
                                      "kernel": 1, "spread": 0.5})
    cache = method.make_cache(model)
    with torch.no_grad():
        model(torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(4)),
              past_key_values=cache, use_cache=True)
    kept = [cache.kept_tokens(l) for l in range(3)]
    assert kept == [18, 12, 6] and sum(kept) / 3 == 12       # SnapKV at 0.5 keeps 12 in every layer
    snap, snap_model = _installed(base, {"name": "snapkv", "compression_ratio": 0.5, "window": 2, "kernel": 1})
    snap_cache = snap.make_cache(snap_model)
    with torch.no_grad():
        snap_model(torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(4)),
                   past_key_values=snap_cache, use_cache=True)
    assert method.cache_nbytes(cache)["data"] == snap.cache_nbytes(snap_cache)["data"]   # equal bytes


class _Recorder:
    """Wraps a policy; records, per decode step, the positions kept before it or selected by it."""

    def __init__(self, policy):
        self.policy, self.read = policy, []

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def visible(self, q_pos, k_pos):
        return self.policy.visible(q_pos, k_pos)

    def keep(self, *args, **kwargs):
        return self.policy.keep(*args, **kwargs)

    def select(self, queries, keys, positions):
        chosen = self.policy.select(queries, keys, positions)
        pos = positions[0, 0]
        self.read.append(set(pos.tolist()) if chosen is None else set(pos[chosen[0, 0]].tolist()))
        return chosen


@pytest.mark.parametrize("conf", [{"name": "tova", "budget": 10}, {"name": "quest", "page": 4, "budget": 8},
                                  {"name": "h2o", "budget": 10, "window": 3}])
def test_decoding_reads_exactly_the_tokens_the_policy_left(conf):
    """One layer, one KV head: every decode step's logits equal the plain model's with that
    query's row masked to the tokens the cache kept (TOVA, H2O) or selected (Quest) for it — so no
    evicted or unselected token is read; the policy really drops some."""
    base = tiny_llama(0, kv_heads=1, layers=1).double()
    method, model = _installed(base, conf)
    recorder = _Recorder(method.policy)
    cache = method.make_cache(model)
    cache.policy = recorder
    T, new = 16, 8
    ids = torch.randint(0, 97, (1, T + new), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        model(ids[:, :T], past_key_values=cache, use_cache=True)
    steps = _stepwise(model, cache, ids[:, T:])
    full = T + new
    mask = torch.tril(torch.ones(full, full, dtype=torch.bool))
    for i, read in enumerate(recorder.read):
        row = torch.zeros(full, dtype=torch.bool)
        row[sorted(read)] = True
        mask[T + i] = row
    assert len(recorder.read) == new and any(len(r) < T + i + 1 for i, r in enumerate(recorder.read))
    with torch.no_grad():
        ref = base(ids, attention_mask=mask[None, None], use_cache=False).logits
    assert (steps - ref[:, T:]).abs().max().item() < TOL


def test_tova_keeps_what_the_last_query_attends_to_most_and_quest_bounds_every_page():
    from palu.methods.quest import QuestPolicy
    from palu.methods.tova import TovaPolicy
    g = torch.Generator().manual_seed(6)
    q, k = torch.randn(1, 2, 3, 8, generator=g), torch.randn(1, 1, 12, 8, generator=g)
    kept = TovaPolicy(5).keep(0, q, k, None, 12, False, scale=0.5)
    weights = ((q[:, :, -1:] @ k.transpose(-1, -2)) * 0.5).softmax(-1)[:, :, 0].mean(1)   # (1, 12)
    assert kept[0, 0].tolist() == sorted(weights[0].topk(5).indices.tolist())
    # Quest's page score is an upper bound of q.k over the page: the page holding the best key is read
    policy = QuestPolicy(page=4, budget=8)
    chosen = policy.select(q, k, torch.arange(12)[None, None])
    best = (q[0, :, -1] @ k[0, 0].T).sum(0).argmax().item()
    assert chosen.shape == (1, 1, 12) and chosen.sum().item() == 8 and chosen[0, 0, best]
    assert chosen[0, 0, 8:].all()                                   # the newest page always


def test_quest_reads_fewer_bytes_than_it_stores():
    base = tiny_llama(0).double()
    method, model = _installed(base, {"name": "quest", "page": 4, "budget": 8})
    cache = method.make_cache(model)
    with torch.no_grad():
        model(torch.randint(0, 97, (1, 40)), past_key_values=cache, use_cache=True)
    n = method.cache_nbytes(cache)
    assert n["read_per_step"] < n["total"] and n["metadata"] > 0


# ---- latent-space selection for Palu ---------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    import palu
    out = {}
    for family in ("llama", "opt"):
        base = FAMILIES[family](0).double()
        model = copy.deepcopy(base)
        kv = palu.geometry_of(base.config).num_kv_heads
        result = palu.compress(model, torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(0)),
                               kept_ratio=0.5, group_size=kv, multiple=8, progress=False)
        path = tmp_path_factory.mktemp(family) / "ckpt"
        result.save(path)
        out[family] = (base, str(path))
    return out


def _select_decode(base, ckpt, tokens, window, sketch=None, recalls=False):
    method, model = _installed(base, {"name": "palu_select", "checkpoint": ckpt, "tokens": tokens,
                                      "window": window, "sketch": sketch})
    if recalls:
        method.selection.recalls = []
    ids = torch.randint(0, 97, (1, 30), generator=torch.Generator().manual_seed(7))
    cache = method.make_cache(model)
    with torch.no_grad():
        model(ids[:, :24], past_key_values=cache, use_cache=True)
    return method, model, _stepwise(model, cache, ids[:, 24:]), ids


def test_latent_selection_reading_every_token_is_palu(checkpoints):
    """tokens + window >= the context: the step reads everything and equals the Palu checkpoint."""
    base, ckpt = checkpoints["llama"]
    _, _, steps, ids = _select_decode(base, ckpt, tokens=64, window=8)
    method, model = _installed(base, {"name": "palu", "checkpoint": ckpt})
    cache = method.make_cache(model)
    with torch.no_grad():
        model(ids[:, :24], past_key_values=cache, use_cache=True)
    assert (_stepwise(model, cache, ids[:, 24:]) - steps).abs().max().item() < TOL


def test_latent_selection_recall_is_a_share_that_rises_with_the_tokens_read(checkpoints):
    """No RoPE (OPT) and every channel: the score is the exact logit summed over the group's
    query heads; the recorded recall (exact attention mass of the chosen tokens) is a share, and
    rises with the number of tokens read."""
    base, ckpt = checkpoints["opt"]
    small, big = [], []
    for tokens, sink in ((4, small), (12, big)):
        method, _, _, _ = _select_decode(base, ckpt, tokens=tokens, window=2, recalls=True)
        sink.extend(method.selection.recalls)
    assert small and all(0 < r <= 1 + 1e-9 for r in small)
    assert all(o >= r - 1e-9 for o, r in zip(method.selection.oracle, method.selection.recalls))
    assert sum(big) / len(big) > sum(small) / len(small)


def test_latent_selection_with_rope_measures_its_recall_and_reads_fewer_bytes(checkpoints):
    base, ckpt = checkpoints["llama"]
    method, model, steps, _ = _select_decode(base, ckpt, tokens=6, window=2, sketch=4, recalls=True)
    assert method.selection.recalls and all(0 < r <= 1 + 1e-9 for r in method.selection.recalls)
    cache = method.make_cache(model)
    with torch.no_grad():
        model(torch.randint(0, 97, (1, 24)), past_key_values=cache, use_cache=True)
    n = method.cache_nbytes(cache)
    assert n["read_per_step"] < n["total"]
    with pytest.raises(MethodError, match="evicts tokens after the prefill"):
        from palu import evaluate_text
        evaluate_text(model, windows=torch.randint(0, 97, (1, 16)), method=method, progress=False)


def test_latent_selection_refuses_a_k_norm_family(tmp_path):
    import palu
    base = FAMILIES["qwen3"](0).double()
    model = copy.deepcopy(base)
    palu.compress(model, torch.randint(0, 97, (2, 16)), kept_ratio=0.5, group_size=1, progress=False).save(tmp_path / "c")
    with pytest.raises(MethodError, match="normalises keys"):
        _installed(base, {"name": "palu_select", "checkpoint": str(tmp_path / "c")})


def test_latent_selection_composes_with_low_bit_latents(checkpoints):
    """palu_select at bits=4: the selection reads dequantised 4-bit latents; with a budget that
    covers the context it equals Palu at 4 bits, and its bytes are the 4-bit cache's."""
    base, ckpt = checkpoints["llama"]
    ids = torch.randint(0, 97, (1, 30), generator=torch.Generator().manual_seed(8))
    outs, sizes = [], []
    for conf in ({"name": "palu", "checkpoint": ckpt, "latent_bits": 4},
                 {"name": "palu_select", "checkpoint": ckpt, "latent_bits": 4, "tokens": 64, "window": 8}):
        method, model = _installed(base, conf)
        cache = method.make_cache(model)
        with torch.no_grad():
            model(ids[:, :24], past_key_values=cache, use_cache=True)
        outs.append(_stepwise(model, cache, ids[:, 24:]))
        sizes.append(method.cache_nbytes(cache)["total"])
    assert (outs[0] - outs[1]).abs().max().item() < TOL and sizes[0] == sizes[1]


def test_h2o_keeps_the_window_and_the_most_attended_older_tokens():
    """The accumulated attention of the prefill's queries decides the first eviction: the kept
    older tokens are the top of that sum, the newest `window` always stay, and the scores held
    are counted as metadata."""
    from palu.methods.h2o import H2OPolicy
    g = torch.Generator().manual_seed(9)
    q, k = torch.randn(1, 2, 12, 8, generator=g), torch.randn(1, 1, 12, 8, generator=g)
    policy = H2OPolicy(budget=6, window=2)
    kept = policy.keep(0, q, k, None, 12, True, scale=0.5)
    logits = (q @ k.transpose(-1, -2)) * 0.5
    logits = logits.masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf"))
    received = logits.softmax(-1).sum(2).sum(1)[0]                  # (12,)
    heavy = sorted(received[:10].topk(4).indices.tolist())
    assert kept[0, 0].tolist() == heavy + [10, 11]
    assert torch.allclose(policy.accumulated[0][0, 0], received[kept[0, 0]].float())
    assert policy.nbytes() == 6 * 4


@pytest.mark.parametrize("chunked", [False, True])
def test_h2o_decides_a_padded_batch_at_once_as_each_row_alone(monkeypatch, chunked):
    """`H2OPolicy.keep_padded` (every row of a left-padded batch at once, queries in chunks) keeps
    the slots and the sums `keep` gives each row alone, at the prefill and at a decode step that
    evicts again (float64). `chunked`: one query a chunk, so the sums cross chunk bounds."""
    import palu.methods.h2o as h2o
    from palu.cache.subset_cache import FILLER, slots_of
    if chunked:
        monkeypatch.setattr("palu.attention.received.SCORES_AT_ONCE", 1)
    g = torch.Generator().manual_seed(4)
    lengths, W, H, rep, d = [12, 7, 4], 12, 2, 3, 8
    q = torch.randn(3, H * rep, W, d, generator=g, dtype=torch.float64)
    k = torch.randn(3, H, W, d, generator=g, dtype=torch.float64)
    pads = torch.tensor([W - n for n in lengths])
    pos = (torch.arange(W)[None] - pads[:, None]).clamp_min(FILLER)[:, None].expand(3, H, W).clone()
    batch = h2o.H2OPolicy(budget=6, window=2)
    held = batch.keep_padded(0, q, k, pos, torch.tensor(lengths), scale=0.4)
    keep = slots_of(held, batch.padded_width(W, lengths))
    batch.kept(0, None if keep is None else keep[0])
    for b, n in enumerate(lengths):
        alone = h2o.H2OPolicy(budget=6, window=2)
        got = alone.keep(0, q[b:b + 1, :, W - n:], k[b:b + 1, :, W - n:], pos[b:b + 1, :, W - n:], n, True, scale=0.4)
        want = torch.arange(n).expand(1, H, n) if got is None else got
        mine = pos[b:b + 1].gather(2, keep[0][b:b + 1]).masked_fill(keep[1][b:b + 1], FILLER)
        assert mine[mine >= 0].view(1, H, -1).tolist() == want.tolist(), b
        sums = batch.accumulated[0][b:b + 1][mine >= 0].view(1, H, -1)
        assert torch.allclose(sums, alone.accumulated[0], rtol=0, atol=0), b
    # one decode step: each row's new token after its kept slots, scored and evicted again
    kk = torch.cat([k.gather(2, keep[0][..., None].expand(-1, -1, -1, d)), torch.randn(3, H, 1, d, generator=g,
                                                                                        dtype=torch.float64)], 2)
    kpos = torch.cat([pos.gather(2, keep[0]).masked_fill(keep[1], FILLER),
                      torch.tensor(lengths).view(3, 1, 1).expand(3, H, 1)], 2)
    q1 = torch.randn(3, H * rep, 1, d, generator=g, dtype=torch.float64)
    held = batch.keep_padded(0, q1, kk, kpos, torch.tensor(lengths) + 1, scale=0.4)
    assert (held.sum(-1) == torch.tensor([6, 6, 5]).view(3, 1)).all()
    assert not bool((held & (kpos < 0)).any())      # never a filler


@pytest.mark.parametrize("conf", [{"name": "streaming_llm", "sink": 2, "window": 6},
                                  {"name": "snapkv", "compression_ratio": 0.5, "window": 4, "kernel": 3},
                                  {"name": "pyramidkv", "compression_ratio": 0.5, "window": 4, "kernel": 3},
                                  {"name": "tova", "budget": 8}, {"name": "h2o", "budget": 8, "window": 2},
                                  {"name": "quest", "page": 4, "budget": 8}])
def test_generate_through_each_cache_is_greedy_decoding_through_it(conf):
    """transformers' generate places new tokens by the tokens *seen* (not the fewer kept) and
    gives what a hand-written greedy loop through the same cache gives."""
    base = tiny_llama(0).double()
    method, model = _installed(base, conf)
    ids = torch.randint(1, 97, (1, 16), generator=torch.Generator().manual_seed(3))   # no pad id
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0,
                             past_key_values=method.make_cache(model))
        cache = method.make_cache(model)
        logits, seq = model(ids, past_key_values=cache, use_cache=True).logits[:, -1], ids
        for _ in range(8):
            nxt = logits.argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
            logits = model(nxt, past_key_values=cache, use_cache=True).logits[:, -1]
    assert torch.equal(out, seq) and cache.get_seq_length() == 24


@pytest.mark.parametrize("policy", ["tova", "streaming_llm"])
def test_a_padded_batch_decides_every_row_at_once_as_each_row_alone(policy):
    """`keep_padded` (every row of a padded batch at once) holds exactly what `keep` holds for
    each row alone over its own tokens, even when the filler slots would win every vote (keys 50x
    larger): a filler is never held in place of a token."""
    from palu.cache.subset_cache import FILLER, gather_slots, real_slots
    from palu.methods.streaming_llm import StreamingPolicy
    from palu.methods.tova import TovaPolicy
    pol = TovaPolicy(budget=5) if policy == "tova" else StreamingPolicy(sink=2, window=4)
    g = torch.Generator().manual_seed(0)
    B, H, n_rep, S, d = 3, 2, 2, 11, 8
    pads = torch.tensor([0, 3, 8])
    keys = torch.randn(B, H, S, d, generator=g, dtype=torch.float64)
    q = torch.randn(B, H * n_rep, 1, d, generator=g, dtype=torch.float64)
    slot = torch.arange(S).expand(B, H, S)
    positions = (slot - pads.view(B, 1, 1)).masked_fill(slot < pads.view(B, 1, 1), FILLER).to(torch.int32)
    keys = torch.where((positions < 0)[..., None], 50 * keys, keys)
    held = pol.keep_padded(0, q, keys, positions, S - pads)
    for b in range(B):
        idx = real_slots(positions[b:b + 1])
        alone = pol.keep(0, q[b:b + 1], gather_slots(keys[b:b + 1], idx), positions[b:b + 1].gather(2, idx),
                         int(S - pads[b]), prefill=False)
        kept = idx if alone is None else idx.gather(2, alone)
        want = torch.zeros(1, H, S, dtype=torch.bool).scatter_(-1, kept, True)
        assert torch.equal(held[b:b + 1], want), (policy, b)


@pytest.mark.parametrize("page,budget", [(2, 4), (4, 12), (3, 9), (16, 64)])
def test_quest_selects_for_every_row_of_a_padded_batch_at_once_as_each_row_alone(page, budget, monkeypatch):
    """`QuestPolicy.select_padded`: each row's pages start at its own first token and are scored
    over its own tokens, so every row reads what `select` chooses for it alone (a row within the
    budget reads all its tokens, a pad never), at lengths around the page and budget edges; and
    a padded batch's decode steps take it, not one `select` call a row."""
    from palu.methods.quest import QuestPolicy
    pol = QuestPolicy(page, budget)
    g = torch.Generator().manual_seed(page * budget)
    for S in (5, 9, 17, 64, 65, 131):
        B, H, n_rep, d = 3, 2, 2, 8
        pads = torch.tensor([0, min(S - 1, 3), min(S - 1, 7)])
        keys = torch.randn(B, H, S, d, generator=g, dtype=torch.float64)
        q = torch.randn(B, H * n_rep, 1, d, generator=g, dtype=torch.float64)
        got = pol.select_padded(q, keys, pads)
        for b in range(B):
            alone = pol.select(q[b:b + 1], keys[b:b + 1, :, int(pads[b]):], None)
            want = torch.zeros(1, H, S, dtype=torch.bool)
            want[..., int(pads[b]):] = True if alone is None else alone
            assert torch.equal(got[b:b + 1], want), (page, budget, S, b)
    calls = []
    monkeypatch.setattr(QuestPolicy, "select", lambda self, *a: calls.append(1))
    method, model = _installed(tiny_llama(0).double(), {"name": "quest", "page": page, "budget": budget})
    ids = torch.tensor([[0, 0, 0, 0, 5, 17, 23, 42, 8, 61, 3, 9], [9, 11, 2, 77, 31, 45, 12, 50, 66, 14, 29, 70]])
    with torch.no_grad():
        model.generate(ids, attention_mask=(ids != 0).long(), max_new_tokens=4, do_sample=False, pad_token_id=0,
                       past_key_values=method.make_cache(model))
    assert not calls


@pytest.mark.parametrize("conf", [{"name": "streaming_llm", "sink": 1, "window": 4},
                                  {"name": "tova", "budget": 5}])
def test_a_padded_batchs_kept_width_known_on_the_host_is_the_fullest_rows(conf, monkeypatch):
    """StreamingLLM and TOVA name the kept width of a padded batch from host counts
    (`SubsetPolicy.padded_width`), so a decode step waits for no device: at every step the cache
    is exactly as wide as its fullest row (no slot is a filler in every row), and the cache holds
    what it holds when the width is counted on the device."""
    import palu.cache.subset_cache as subset_cache
    base = tiny_llama(0).double()
    method, model = _installed(base, conf)
    prompts = [[5, 17, 23, 42, 8, 61, 3], [9, 11, 2, 77, 31, 45, 12, 50, 66, 14, 29, 70], [4, 88, 19]]
    n = max(map(len, prompts))
    ids = torch.tensor([[0] * (n - len(p)) + p for p in prompts])
    mask = (torch.arange(n)[None] >= torch.tensor([n - len(p) for p in prompts])[:, None]).long()

    def run():
        cache = method.make_cache(model)
        widths, x, m = [], ids, mask
        with torch.no_grad():
            for _ in range(10):
                logits = model(x, attention_mask=m, past_key_values=cache, use_cache=True).logits[:, -1]
                x, m = logits.argmax(-1, keepdim=True), torch.cat([m, torch.ones(3, 1, dtype=torch.long)], 1)
                for lay in cache.layers:
                    real = (lay.positions >= 0).sum(-1)                      # (B, H)
                    widths.append((lay.positions.shape[-1], int(real.max())))
        return cache, widths
    cache, widths = run()
    assert all(slots == fullest for slots, fullest in widths), widths
    assert min(slots for slots, _ in widths) < n + 10          # it evicted
    monkeypatch.setattr(type(method.policy), "padded_width", lambda self, slots, seen: None)
    device, _ = run()
    for a, b in zip(cache.layers, device.layers):
        assert torch.equal(a.positions, b.positions) and torch.equal(a.keys, b.keys)


@pytest.mark.parametrize("policy,chunked", [("snapkv", False), ("snapkv", True), ("pyramidkv", False), ("tova", False)])
def test_a_right_padded_prefill_chooses_every_row_at_once_as_each_row_alone(policy, chunked, monkeypatch):
    """`keep_right_padded` (every row of a right-padded prefill at once: SnapKV's batched votes and
    top-k; TOVA through its row-by-row fallback) keeps, in each row's first counts[b] entries,
    exactly what `keep` keeps for the row alone over its first lengths[b] queries and keys: rows
    shorter than the window or whose budget keeps them whole included, pads 50x larger (they
    would win every vote) never chosen. `chunked`: the votes a row at a time (their memory cap)."""
    from palu.attention import observation
    from palu.methods.pyramidkv import PyramidPolicy
    from palu.methods.snapkv import SnapKVPolicy
    from palu.methods.tova import TovaPolicy
    pol = {"snapkv": lambda: SnapKVPolicy(0.5, 4, 3), "pyramidkv": lambda: PyramidPolicy(0.6, 4, 3, 0.5, 3),
           "tova": lambda: TovaPolicy(budget=6)}[policy]()
    if chunked:
        monkeypatch.setattr(observation, "VOTE_BYTES", 1)
    g = torch.Generator().manual_seed(0)
    lengths = [23, 17, 4, 3, 9, 6, 11]
    B, H, n_rep, S, d = len(lengths), 2, 3, max(lengths), 8
    keys = torch.randn(B, H, S, d, generator=g, dtype=torch.float64)
    q = torch.randn(B, H * n_rep, S, d, generator=g, dtype=torch.float64)
    pad = torch.arange(S)[None, None, :, None] >= torch.tensor(lengths)[:, None, None, None]
    keys, q = torch.where(pad, 50 * keys, keys), torch.where(pad, 50 * q, q)
    for b, n in enumerate(lengths):   # the token before the window draws the window's attention,
        if n > 5:                     # so the pooled votes spill past the row's older tokens
            keys[b, :, n - 5] = 5 * q[b, :, n - 4:n].sum(1).view(H, n_rep, d).mean(1)
    for layer in (0, 2):
        index, counts = pol.keep_right_padded(layer, q, keys, lengths, scale=0.3)
        assert index is not None and index.shape[0] == B
        for b, n in enumerate(lengths):
            alone = pol.keep(layer, q[b:b + 1, :, :n], keys[b:b + 1, :, :n], None, n, prefill=True, scale=0.3)
            want = torch.arange(n).expand(1, H, n) if alone is None else alone
            assert counts[b] == want.shape[-1], (policy, layer, b)
            assert torch.equal(index[b:b + 1, :, :counts[b]].expand(1, H, -1), want), (policy, layer, b)
            assert int(index[b, :, :counts[b]].max()) < n


def test_a_right_padded_prefill_where_no_row_evicts_keeps_every_token():
    from palu.methods.snapkv import SnapKVPolicy
    keys = torch.randn(2, 1, 5, 4, dtype=torch.float64)
    index, counts = SnapKVPolicy(0.5, 8, 1).keep_right_padded(0, keys, keys, [5, 3])
    assert index is None and counts == [5, 3]
