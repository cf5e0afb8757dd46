"""Padded batches through every cache method (issue 34, item 1): each row of a left-padded batch
generates what its prompt generates alone, or the method refuses padded input by name.

Per-token methods (FP16, Palu's latents at any width, Atom, TurboQuant) code every token from
itself, so a pad token beside it changes nothing. KIVI groups 32 consecutive tokens per channel
and keeps the newest 128 exact, KVQuant keeps the first cached token exact: in a padded row those
groups, that window and that first token are counted from the pad tokens, so the real tokens
would be coded differently than alone (seen: 6 of 40 tokens changed for KIVI-2, 24-30 of 30 for
KVQuant). They refuse a padded batch instead; one-prompt batches are unaffected.

| method | left padding | right padding (one pass) |
|---|---|---|
| fp16, palu (16 / 4 / 2-bit), atom, turboquant | equal to the prompt alone | equal |
| kivi, kvquant | refused (ValueError naming the method) | refused |
"""
import copy

import pytest
import torch

import palu
from palu.methods import build_method
from palu.calib.kvquant import fit_kvquant
from tiny import tiny_llama

PAD = 0
PROMPTS = [[5, 17, 23, 42, 8, 61, 3], [9, 11, 2, 77, 31, 45, 12, 50, 66, 14, 29, 70]]
PER_TOKEN = ["fp16", "palu-b16", "palu-b4", "palu-b2", "atom-b4", "turboquant-b3"]
GROUPED = ["kivi-b2", "kvquant-b3"]


@pytest.fixture(scope="module")
def methods(tmp_path_factory):
    base = tiny_llama(0).double()
    calib = torch.randint(1, 97, (4, 32), generator=torch.Generator().manual_seed(3))
    compressed = copy.deepcopy(base)
    ckpt = tmp_path_factory.mktemp("palu") / "ckpt"
    palu.compress(compressed, calib, kept_ratio=0.5, group_size=2, progress=False).save(ckpt)
    state = tmp_path_factory.mktemp("kvq") / "state"
    fit_kvquant(copy.deepcopy(base), calib, bits=3, weighting="uniform", tokens_per_window=16,
                progress=False).save(state)
    confs = {"fp16": {"name": "fp16"}, "atom-b4": {"name": "atom", "bits": 4},
             "turboquant-b3": {"name": "turboquant", "bits": 3},
             "kivi-b2": {"name": "kivi", "bits": 2, "group": 4, "residual": 4},
             "kvquant-b3": {"name": "kvquant", "state": str(state)},
             **{f"palu-b{b}": {"name": "palu", "checkpoint": str(ckpt), "bits": b} for b in (16, 4, 2)}}
    out = {}
    for name, conf in confs.items():
        method = build_method(conf)
        model = copy.deepcopy(base)
        method.install(model)
        out[name] = (method, model)
    return out


def _left_padded():
    n = max(map(len, PROMPTS))
    ids = torch.tensor([[PAD] * (n - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in PROMPTS])
    return ids, mask


def _generate(model, method, ids, mask=None):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                              pad_token_id=PAD, past_key_values=method.make_cache(model))


@pytest.mark.parametrize("name", PER_TOKEN)
def test_each_row_of_a_left_padded_batch_generates_what_its_prompt_does_alone(methods, name):
    method, model = methods[name]
    ids, mask = _left_padded()
    batch = _generate(model, method, ids, mask)[:, ids.shape[1]:]
    for row, prompt in enumerate(PROMPTS):
        alone = _generate(model, method, torch.tensor([prompt]))[0, len(prompt):]
        assert torch.equal(batch[row], alone), (name, row)


@pytest.mark.parametrize("name", PER_TOKEN)
def test_right_padding_leaves_the_real_tokens_logits_alone(methods, name):
    """One prefill of a right-padded batch: each row's real tokens score as alone."""
    method, model = methods[name]
    n = max(map(len, PROMPTS))
    ids = torch.tensor([p + [PAD] * (n - len(p)) for p in PROMPTS])
    mask = torch.tensor([[1] * len(p) + [0] * (n - len(p)) for p in PROMPTS])
    with torch.no_grad():
        batch = model(ids, attention_mask=mask, past_key_values=method.make_cache(model)).logits
        for row, prompt in enumerate(PROMPTS):
            alone = model(torch.tensor([prompt]), past_key_values=method.make_cache(model)).logits[0]
            assert torch.allclose(batch[row, :len(prompt)], alone, rtol=0, atol=1e-9), (name, row)


@pytest.mark.parametrize("name", GROUPED)
def test_a_grouping_method_refuses_a_padded_batch_by_name(methods, name):
    method, model = methods[name]
    ids, mask = _left_padded()
    with pytest.raises(ValueError, match=rf"{method.tag}.*padded batch"):
        _generate(model, method, ids, mask)
    n = max(map(len, PROMPTS))
    right = torch.tensor([p + [PAD] * (n - len(p)) for p in PROMPTS])
    rmask = torch.tensor([[1] * len(p) + [0] * (n - len(p)) for p in PROMPTS])
    with pytest.raises(ValueError, match="padded batch"), torch.no_grad():
        model(right, attention_mask=rmask, past_key_values=method.make_cache(model))
    # a batch without padding (an all-ones mask) and one prompt alone still run
    _generate(model, method, torch.tensor([PROMPTS[0]] * 2), torch.ones(2, len(PROMPTS[0]), dtype=torch.long))
    _generate(model, method, torch.tensor([PROMPTS[1]]))
