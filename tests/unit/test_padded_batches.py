"""Padded batches through every registered method (issues 34 and 49): each row of a left-padded
batch of prompts of different lengths gets what its prompt gets alone — every step's logits
within 1e-9 in float64 (the prefill's last position and each decode step) and the same tokens,
and through `answer_batches` the same answer and the same bytes — or the method refuses a padded
batch by name. Parametrised over `method_names()`: a new method must be added to CONFIGS.

| method | left-padded batch |
|---|---|
| fp16, palu (16 / 4 / 2-bit), atom, turboquant | equal to each prompt alone (per-token storage) |
| snapkv, pyramidkv, streaming_llm, tova, h2o, quest | equal to each prompt alone (each row's policy decides over its own tokens, ragged kept sets led by masked fillers; bytes from the row's own view) |
| kivi, kivi_vscale, kvquant, kivi_snapkv | equal to each prompt alone (the rows are apart: one row layer each, its groups, window and sink counted from its first token; kivi_snapkv: each row layer evicts among its own tokens) |
| palu_snapkv, palu_tova (16 / 4-bit) | equal to each prompt alone (each row scores its own tokens with its own queries, after the prefill or every step; ragged kept sets led by masked filler slots, the latent cache's own mask) |
| palu_select | equal to each prompt alone (a row chooses among its own tokens; the chosen are read through its mask) |
"""
import copy

import pytest
import torch

from palu.calib.kvquant import fit_kvquant
from palu.eval.generation import answer_batches
from palu.methods import build_method, method_names

PAD = 0
PROMPTS = [[5, 17, 23, 42, 8, 61, 3], [9, 11, 2, 77, 31, 45, 12, 50, 66, 14, 29, 70], [4, 88, 19]]
EVICT = {"evict_ratio": 0.5, "evict_window": 2, "evict_kernel": 1}
CONFIGS = {   # method name -> {variant: config} (paths filled in by the fixture)
    "fp16": {"fp16": {}},
    "palu": {f"palu-b{b}": {"checkpoint": "CKPT", "latent_bits": b} for b in (16, 4, 2)},
    "atom": {"atom-b4": {"bits": 4}},
    "turboquant": {"turboquant-b3": {"bits": 3}},
    "kivi": {"kivi-b2": {"bits": 2, "group": 4, "residual": 4}},
    "kvquant": {"kvquant-b3": {"state": "STATE"}},
    "kivi_vscale": {"kivi_vscale-b2": {"bits": 2, "group": 4, "residual": 4, "state": "VSTATE"}},
    "kivi_snapkv": {"kivi_snapkv": {"bits": 2, "group": 4, "residual": 4, **EVICT}},
    "snapkv": {"snapkv": {"compression_ratio": 0.5, "window": 2, "kernel": 1}},
    "pyramidkv": {"pyramidkv": {"compression_ratio": 0.5, "window": 2, "kernel": 1}},
    "streaming_llm": {"streaming_llm": {"sink": 1, "window": 4}},
    "tova": {"tova": {"budget": 6}},
    "h2o": {"h2o": {"budget": 6, "window": 2}},
    "quest": {"quest": {"page": 2, "budget": 4}},
    "palu_select": {"palu_select": {"checkpoint": "CKPT", "tokens": 4, "window": 2}},
    "palu_snapkv": {f"palu_snapkv-b{b}": {"checkpoint": "CKPT", "latent_bits": b, **EVICT} for b in (16, 4)},
    "palu_tova": {f"palu_tova-b{b}": {"checkpoint": "CKPT", "latent_bits": b, "budget": 5} for b in (16, 4)},
}
VARIANTS = [(name, variant) for name in method_names() for variant in CONFIGS.get(name, {None: None})]
TABLE: dict[str, str] = {}


@pytest.fixture(scope="module")
def base(tiny_base):
    return tiny_base


@pytest.fixture(scope="module")
def paths(base, tiny_palu_checkpoint, tmp_path_factory):
    calib = torch.randint(1, 97, (4, 32), generator=torch.Generator().manual_seed(3))
    ckpt = tiny_palu_checkpoint
    state = tmp_path_factory.mktemp("kvq") / "state"
    fit_kvquant(copy.deepcopy(base), calib, bits=3, weighting="uniform", tokens_per_window=16,
                progress=False).save(state)
    from tiny import fitted_state
    vstate = fitted_state("kivi_vscale", base, tmp_path_factory.mktemp("vscale") / "state", calib)
    return {"CKPT": str(ckpt), "STATE": str(state), "VSTATE": vstate}


@pytest.fixture(scope="module", autouse=True)
def print_table():
    yield
    rows = "\n".join(f"| {v} | {TABLE[v]} |" for v in sorted(TABLE))
    print(f"\n\nPadded batches (left padding, float64), every registered method:\n| method | row by row |\n|---|---|\n{rows}\n")


def _installed(base, paths, name, variant):
    conf = {k: paths.get(v, v) if isinstance(v, str) else v for k, v in CONFIGS[name][variant].items()}
    method = build_method({"name": name, **conf})
    model = copy.deepcopy(base)
    method.install(model)
    return method, model


class Tok:
    """What `answer_batches` reads of a tokenizer (ids are decoded as their numbers)."""
    pad_token_id, eos_token_id = PAD, 2

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids if not (skip_special_tokens and i in (PAD, 2)))


def _generate(model, method, prompts):
    n = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (n - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=PAD,
                             past_key_values=method.make_cache(model), output_scores=True,
                             return_dict_in_generate=True)
    return out.sequences[:, n:], torch.stack(out.scores, 1)    # (B, new), (B, new, vocab)


@pytest.mark.parametrize("name,variant", VARIANTS)
def test_each_row_of_a_padded_batch_is_its_prompt_alone_or_refused(base, paths, name, variant):
    assert variant is not None, f"method {name!r} has no tiny config in CONFIGS: add one"
    method, model = _installed(base, paths, name, variant)
    if not method.padded_batches:
        with pytest.raises(ValueError, match="padded batch") as err:
            _generate(model, method, PROMPTS)
        TABLE[variant] = f"refused: {str(err.value)[:110]}"
        _generate(model, method, [PROMPTS[0]])      # one prompt alone still runs
        return
    tokens, scores = _generate(model, method, PROMPTS)
    for row, prompt in enumerate(PROMPTS):
        alone_tokens, alone_scores = _generate(model, method, [prompt])
        assert torch.equal(tokens[row], alone_tokens[0]), (variant, row)
        diff = (scores[row] - alone_scores[0]).abs().max().item()
        assert diff <= 1e-9, (variant, row, diff)
    batched = answer_batches(model, Tok(), method, PROMPTS, 8, batch_size=3)
    one = answer_batches(model, Tok(), method, PROMPTS, 8, batch_size=1)
    assert batched == one, variant          # answers and each row's bytes, as stored
    TABLE[variant] = "exact: logits within 1e-9, same tokens, answers and bytes"


@pytest.mark.parametrize("variant", ["fp16", "palu-b16", "palu-b4", "atom-b4", "turboquant-b3"])
def test_right_padding_leaves_the_real_tokens_logits_alone(base, paths, variant):
    """One prefill of a right-padded batch: each row's real tokens score as alone."""
    name = next(n for n, v in VARIANTS if v == variant)
    method, model = _installed(base, paths, name, variant)
    n = max(map(len, PROMPTS))
    ids = torch.tensor([p + [PAD] * (n - len(p)) for p in PROMPTS])
    mask = torch.tensor([[1] * len(p) + [0] * (n - len(p)) for p in PROMPTS])
    with torch.no_grad():
        batch = model(ids, attention_mask=mask, past_key_values=method.make_cache(model)).logits
        for row, prompt in enumerate(PROMPTS):
            alone = model(torch.tensor([prompt]), past_key_values=method.make_cache(model)).logits[0]
            assert torch.allclose(batch[row, :len(prompt)], alone, rtol=0, atol=1e-9), (variant, row)


def test_answer_batches_keeps_the_order_and_the_answer_lengths_given(base, paths):
    """Prompts come back in the order given whatever the batching; a batch holds one answer
    length; a method that cannot batch answers one prompt at a time (same answers)."""
    prompts = PROMPTS + [[7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7], [30, 31]]
    news = [3, 8, 8, 3, 5]
    fp16, model = _installed(base, paths, "fp16", "fp16")
    alone = [answer_batches(model, Tok(), fp16, [p], n)[0] for p, n in zip(prompts, news)]
    assert answer_batches(model, Tok(), fp16, prompts, news, batch_size=4) == alone
    assert answer_batches(model, Tok(), None, prompts, news, batch_size=2) == \
        [answer_batches(model, Tok(), None, [p], n)[0] for p, n in zip(prompts, news)]
    snap, snap_model = _installed(base, paths, "snapkv", "snapkv")
    assert answer_batches(snap_model, Tok(), snap, prompts, news, batch_size=4) == \
        [answer_batches(snap_model, Tok(), snap, [p], n)[0] for p, n in zip(prompts, news)]
    with pytest.raises(ValueError, match="batch_size=0"):
        answer_batches(model, Tok(), fp16, prompts, news, batch_size=0)
    with pytest.raises(ValueError, match="5 prompts but 2 answer lengths"):
        answer_batches(model, Tok(), fp16, prompts, [3, 4], batch_size=2)


@pytest.mark.parametrize("name,variant", [(n, v) for n, v in VARIANTS if v is not None])
def test_perplexity_windows_in_a_batch_score_as_one_at_a_time(base, paths, name, variant):
    """Equal-length windows (no padding) in one prefill: every one-pass method gives each window
    what it gives alone (float64), and the bytes reported are one window's, as at batch 1."""
    from palu.eval.perplexity import perplexity
    method, model = _installed(base, paths, name, variant)
    if not method.one_pass:
        pytest.skip(f"{name} has no one-pass perplexity (refused by check_one_pass)")
    windows = torch.randint(3, 97, (3, 24), generator=torch.Generator().manual_seed(5))
    runs = [perplexity(model, windows, batch_size=b, progress=False, make_cache=lambda: method.make_cache(model),
                       cache_nbytes=method.cache_nbytes) for b in (1, 3)]
    assert abs(runs[0]["ppl"] - runs[1]["ppl"]) <= 1e-12 * runs[0]["ppl"], variant
    assert max(abs(a - b) for a, b in zip(runs[0]["block_nll"], runs[1]["block_nll"])) <= 1e-9
    one, three = runs[0]["cache_nbytes"], runs[1]["cache_nbytes"]
    assert one.keys() == three.keys() and all(
        abs(one[k] - three[k]) <= 1e-9 * max(1, abs(one[k])) for k in one if not isinstance(one[k], bool)), (one, three)


@pytest.mark.parametrize("name,variant", [(n, v) for n, v in VARIANTS if v is not None])
def test_generate_without_the_methods_cache_gives_its_answer_or_is_refused(base, paths, name, variant):
    """Issue 51, item 3: `generate(use_cache=False)` (or a forward with no cache) on a model with a
    method installed gives what generating through the method's cache gives (per-token and
    one-pass methods: each step's fresh cache holds what the real one would), or is refused by
    name (4-bit Palu would run 16-bit; eviction / selection would evict nothing)."""
    method, model = _installed(base, paths, name, variant)
    prompt = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        through = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=PAD,
                                 past_key_values=method.make_cache(model))
        try:
            without = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=PAD, use_cache=False)
        except ValueError as err:
            assert "make_cache" in str(err), str(err)
            assert (name.startswith("palu") and method.latent_bits != 16) or not method.one_pass, str(err)
            return
    assert torch.equal(without, through), variant


@pytest.mark.parametrize("name,variant", [(n, v) for n, v in VARIANTS if v is not None])
def test_methods_that_refuse_padding_batch_prompts_of_one_length(base, paths, name, variant):
    """A method that refuses a padded batch (none registered since session 32: KIVI, KVQuant and
    the SnapKV compositions were) must still be exact on an unpadded one: `answer_batches` groups
    prompts of one length, and each row's answer and bytes (taken when the row ends) equal
    batch 1's."""
    method, model = _installed(base, paths, name, variant)
    if method.padded_batches:
        pytest.skip("batches prompts of any length (the test above)")
    prompts = [PROMPTS[1], PROMPTS[1][::-1], PROMPTS[0], [7, 7, 8, 9, 10, 11, 12], PROMPTS[2]]
    batched = answer_batches(model, Tok(), method, prompts, 8, batch_size=4)
    assert batched == answer_batches(model, Tok(), method, prompts, 8, batch_size=1), variant


@pytest.mark.parametrize("name,variant", [(n, v) for n, v in VARIANTS if v is not None])
def test_a_row_leaves_the_batch_at_its_stop_token_and_answers_as_generate(base, paths, name, variant,
                                                                          monkeypatch):
    """Issue 49: a row that emits a stop token leaves the batch, its cache rows with it, so finished
    rows stop costing work; every row's answer and bytes equal those of transformers' `generate`
    through the same cache (where finished rows decode pads until the batch ends)."""
    from palu.eval import generation
    method, model = _installed(base, paths, name, variant)
    tokens, _ = _generate(model, method, PROMPTS)
    model.generation_config.eos_token_id = int(tokens[0, 2])   # row 0 stops by its third token
    sizes = []
    hook = model.model.layers[0].register_forward_pre_hook(lambda mod, args, kw: sizes.append(args[0].shape[0])
                                                           if args else sizes.append(kw["hidden_states"].shape[0]),
                                                           with_kwargs=True)
    ours = answer_batches(model, Tok(), method, PROMPTS, 8, batch_size=3)
    hook.remove()
    assert sizes[0] == 3 and min(sizes) < 3, sizes            # row 0 left the batch
    monkeypatch.setattr(generation, "plain_greedy", lambda model: False)
    assert ours == answer_batches(model, Tok(), method, PROMPTS, 8, batch_size=3), variant


class _OnTheGPU(torch.Tensor):
    """Row indices as a GPU run hands them to a cache (`_decode_dropping_ended_rows`, beam
    search): indexing a tensor with them fails, as a CUDA index does a host-side CPU tensor, until
    they are moved to that tensor's device."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.__getitem__, torch.Tensor.index_select):
            raise RuntimeError("indices should be either on cpu or on the same device as the indexed tensor (cpu)")
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        return out.as_subclass(torch.Tensor) if isinstance(out, torch.Tensor) else out


def test_row_edits_move_the_indices_to_each_tensors_device():
    """Seen on the H200 (2026-12-04): SnapKV, TOVA, Quest and KIVI-4 failed their long-context jobs
    when a finished row left the batch, since their host-side row lists were indexed with the
    CUDA index. Every per-row map of the row-edit protocol now takes `indices.to(t.device)`."""
    from palu.cache.protocol import RowEdits

    class Rows(RowEdits):
        def __init__(self):
            self.host = torch.arange(4.)

        def _map_rows(self, fn):
            self.host = fn(self.host)
    rows = Rows()
    rows.batch_select_indices(torch.tensor([2, 0]).as_subclass(_OnTheGPU))
    assert rows.host.tolist() == [2.0, 0.0]
    rows.reorder_cache(torch.tensor([1, 1]).as_subclass(_OnTheGPU))
    assert rows.host.tolist() == [0.0, 0.0]
