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


# ---- issue 51, item 10 ------------------------------------------------------------------------
def test_palu_snapkv_with_a_prompt_inside_its_window_keeps_everything_as_snapkv_does(tmp_path):
    """Was a tensor-shape RuntimeError (the window's votes over a 3-token prompt)."""
    base = tiny_llama(0).double()
    calib = torch.randint(1, 97, (4, 32), generator=torch.Generator().manual_seed(3))
    palu.compress(copy.deepcopy(base), calib, kept_ratio=0.5, group_size=2, progress=False).save(tmp_path / "c")
    ids = torch.tensor([[5, 17, 23]])
    out = {}
    for conf in ({"name": "palu", "checkpoint": str(tmp_path / "c")},
                 {"name": "palu_snapkv", "checkpoint": str(tmp_path / "c"), "evict_window": 8, "evict_kernel": 1}):
        model, method = copy.deepcopy(base), build_method(conf)
        method.install(model)
        out[conf["name"]] = model.generate(ids, max_new_tokens=4, do_sample=False,
                                           past_key_values=method.make_cache(model))
    assert torch.equal(out["palu"], out["palu_snapkv"])


def _c4(root, train: bytes, gz: bool = True):
    import gzip
    root.mkdir()
    (root / ("c4-train.json.gz" if gz else "c4-train.json")).write_bytes(gzip.compress(train) if gz else train)
    (root / "c4-validation.json").write_text('{"text": "fine"}\n')
    return root


@pytest.mark.parametrize("train,gz,match", [
    (b"not gzip", None, "c4-train.json.gz line 1 cannot be read .BadGzipFile"),
    (b'{"text": "a"}\n{"txt": "b"}\n', True, "c4-train.json.gz line 2 has no \"text\" string .keys: \\['txt'\\]"),
    (b'{"text": "a"}\n{"text": "b\n', True, "c4-train.json.gz line 2 cannot be read .JSONDecodeError"),
    (b'{"text": "a \\ud800 b"}\n', True, "c4-train.json.gz line 1: character 2 is a lone surrogate"),
    (b'{"text": "a \xff"}\n', False, "c4-train.json line 1 cannot be read .UnicodeDecodeError"),
    (b"\n\n", True, "c4-train.json.gz holds no documents"),
])
def test_malformed_c4_shards_are_named_with_their_line(tmp_path, train, gz, match):
    """Were gzip / JSON / KeyError / UnicodeError naming no file (or a tokenizer error later)."""
    from palu.data.corpora import CorpusFileError, load_corpus
    root = tmp_path / "c4"
    if gz is None:
        root.mkdir()
        (root / "c4-train.json.gz").write_bytes(train)
        (root / "c4-validation.json").write_text('{"text": "fine"}\n')
    else:
        _c4(root, train, gz)
    with pytest.raises(CorpusFileError, match=match):
        load_corpus("c4", path=str(root))


def test_corpus_files_not_utf8_or_empty_are_named(tmp_path):
    """Were a UnicodeDecodeError naming no file, and an empty file reported as an empty text=."""
    from palu.data.corpora import CorpusFileError, load_corpus
    (tmp_path / "wiki.train.raw").write_bytes("café".encode("latin-1"))
    (tmp_path / "wiki.test.raw").write_text("fine")
    with pytest.raises(CorpusFileError, match="wiki.train.raw is not UTF-8 .byte 3.*iconv"):
        load_corpus("wikitext2", path=str(tmp_path))
    (tmp_path / "wiki.train.raw").write_text("fine")
    (tmp_path / "wiki.test.raw").write_text(" \n\n")
    with pytest.raises(CorpusFileError, match="wiki.test.raw holds no text"):
        load_corpus("wikitext2", path=str(tmp_path))


def test_a_lone_surrogate_in_text_is_named():
    """Was a tokenizer's UnicodeEncodeError ('surrogates not allowed') from inside tokenizers."""
    with pytest.raises(ValueError, match="text=: character 4 is a lone surrogate"):
        palu.evaluate_text(tiny_llama(0), tiny_tokenizer(), text="the \ud800 cat", seqlen=4, progress=False)


@pytest.mark.parametrize("fraction", [0, 1, -0.1, 1.5, True, "0.3"])
def test_calibration_fraction_outside_zero_one_is_refused_by_the_library(fraction):
    """Was accepted: 0 gave an empty calibration part, 1 an empty evaluation part."""
    from palu.data.corpora import load_corpus
    with pytest.raises(ValueError, match=f"calibration_fraction={fraction!r} must be a number in \\(0, 1\\)"):
        load_corpus("wiki_standin", calibration_fraction=fraction)


def test_a_checkpoint_on_the_same_model_in_another_dtype_says_so(tmp_path):
    """Was 'made from another model' (the hash is of the weights as loaded)."""
    base = tiny_llama(0)
    calib = torch.randint(1, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    palu.compress(copy.deepcopy(base), calib, kept_ratio=0.5, group_size=2, progress=False).save(tmp_path / "c")
    with pytest.raises(palu.decompose.checkpoint.CheckpointError,
                       match="loaded in float32; the model given is in bfloat16.*load the model in float32"):
        palu.load_compressed(copy.deepcopy(base).to(torch.bfloat16), tmp_path / "c")
    with pytest.raises(palu.decompose.checkpoint.CheckpointError, match="attention hash"):
        palu.load_compressed(tiny_llama(1), tmp_path / "c")
