"""Errors a user can read (issue 34, item 4): each bad input is a ValueError / TypeError naming
the value, where it used to be a ZeroDivisionError, IndexError, AttributeError or silence."""
import copy

import pytest
import torch

import palu
from palu.methods import build_method
from tiny import WORDS, tiny_llama, tiny_tokenizer


def test_a_window_of_one_token_is_refused():
    """Was ZeroDivisionError: one token leaves nothing to score."""
    with pytest.raises(ValueError, match="seqlen=1: a window needs at least 2 tokens"):
        palu.evaluate_text(tiny_llama(0), tiny_tokenizer(), text=" ".join(WORDS * 3), seqlen=1, progress=False)
    with pytest.raises(ValueError, match=r"T >= 2"):
        palu.evaluate_text(tiny_llama(0), windows=torch.zeros(3, 1, dtype=torch.long), progress=False)


def test_token_ids_outside_the_vocabulary_are_named():
    """Was IndexError inside the embedding."""
    windows = torch.randint(0, 97, (2, 16))
    windows[1, 5] = 500
    with pytest.raises(ValueError, match="token id 500 is outside the model's vocabulary of 97 ids"):
        palu.evaluate_text(tiny_llama(0), windows=windows, progress=False)


@pytest.mark.parametrize("conf", [{"name": "kivi", "bits": 2, "group": 4, "residual": 4},
                                  {"name": "atom", "bits": 4}])
def test_prompt_lookup_decoding_through_a_quantised_cache_is_refused(conf):
    """Was AttributeError: 'QuantKVLayer' object has no attribute 'crop'."""
    model = tiny_llama(0)
    method = build_method(conf)
    method.install(model)
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]])
    with pytest.raises(TypeError, match="cannot crop tokens it has coded"):
        model.generate(ids, max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=3,
                       past_key_values=method.make_cache(model))
    model.generate(ids, max_new_tokens=4, do_sample=False, past_key_values=method.make_cache(model))


def test_calibration_text_too_short_for_distinct_windows_is_refused():
    """Was 16 identical windows, silently."""
    tok = tiny_tokenizer()
    text = " ".join(WORDS[:40])
    with pytest.raises(ValueError, match=r"room for \d+ different windows of seqlen=32, fewer than the 16"):
        palu.calibration_data(tok, text=text, samples=16, seqlen=32)
    assert palu.calibration_data(tok, text=text, samples=2, seqlen=32).shape == (2, 32)


def test_calibration_windows_longer_than_the_models_positions_are_refused():
    model = tiny_llama(0)       # 256 positions
    with pytest.raises(ValueError, match="calibration: seqlen=300 exceeds the model's maximum of 256"):
        palu.compress(copy.deepcopy(model), torch.randint(0, 97, (2, 300)), progress=False)
    with pytest.raises(ValueError, match="fisher_windows: seqlen=300"):
        palu.compress(copy.deepcopy(model), torch.randint(0, 97, (2, 32)), rank_method="fisher",
                      fisher_windows=torch.randint(0, 97, (2, 300)), progress=False)
