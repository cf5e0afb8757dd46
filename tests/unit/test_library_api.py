"""The sweep-facing library API: own text for calibration and evaluation, one Fisher default,
no silent fallback to the Gram windows."""
import copy
from pathlib import Path

import pytest
import torch
import yaml

import palu
from palu.compress import FISHER_DEFAULTS
from palu.eval.perplexity import perplexity
from tiny import WORDS, tiny_llama, tiny_tokenizer

TEXT = " ".join(WORDS * 40)


def test_calibration_data_takes_your_own_text():
    tok = tiny_tokenizer()
    windows = palu.calibration_data(tok, text=TEXT, samples=3, seqlen=16, seed=0)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert windows.shape == (3, 16)
    joined = ",".join(map(str, ids))
    for row in windows.tolist():          # every window is a contiguous stretch of the text
        assert ",".join(map(str, row)) in joined
    with pytest.raises(ValueError, match="text="):
        palu.calibration_data(tok, text="   ")


def test_fisher_default_is_the_pipelines():
    from hydra import compose, initialize_config_dir

    from palu.pipeline.config import CONF_DIR, register, validate
    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        conf = validate(compose(config_name="config"))
    assert dict(conf.fisher) == FISHER_DEFAULTS
    tok = tiny_tokenizer()
    a = palu.fisher_data(tok, text=TEXT, seqlen=16)
    b = palu.calibration_data(tok, text=TEXT, samples=FISHER_DEFAULTS["samples"], seqlen=16,
                              seed=FISHER_DEFAULTS["seed"])
    assert torch.equal(a, b) and not torch.equal(a, palu.calibration_data(tok, text=TEXT, samples=8, seqlen=16))


@pytest.mark.parametrize("method", ["fisher", "error_aware"])
def test_a_fisher_method_without_fisher_windows_is_an_error(method):
    calib = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="fisher_windows"):
        palu.compress(tiny_llama(0), calib, rank_method=method, multiple=2, progress=False)


def test_evaluate_text_equals_perplexity_on_the_same_windows():
    tok = tiny_tokenizer()
    model = tiny_llama(0).double()
    out = palu.evaluate_text(model, tok, text=TEXT, seqlen=32, max_tokens=256, progress=False)
    ids = torch.tensor(tok(TEXT, add_special_tokens=False)["input_ids"][:256]).view(8, 32)
    ref = perplexity(model, ids, progress=False)
    assert out["ppl"] == pytest.approx(ref["ppl"], rel=1e-12) and out["tokens"] == 256
    assert out["ppl_lo"] < out["ppl"] < out["ppl_hi"]
    same = palu.evaluate_text(model, windows=ids, progress=False)
    assert same["ppl"] == pytest.approx(ref["ppl"], rel=1e-12) and same["block_nll"] == out["block_nll"]


def test_evaluate_text_through_a_method_cache_matches_the_uncached_model(tmp_path):
    tok = tiny_tokenizer()
    base = tiny_llama(0).double()
    calib = palu.calibration_data(tok, text=TEXT, samples=2, seqlen=32)
    palu.compress(copy.deepcopy(base), calib, kept_ratio=0.5, group_size=2, multiple=8,
                  progress=False).save(tmp_path / "c")
    method = palu.build_method({"name": "palu", "checkpoint": str(tmp_path / "c")})
    model = copy.deepcopy(base)
    method.install(model)
    ids = torch.tensor(tok(TEXT, add_special_tokens=False)["input_ids"][:128]).view(4, 32)
    with_cache = palu.evaluate_text(model, windows=ids, method=method, progress=False)
    plain = palu.evaluate_text(model, windows=ids, progress=False)
    assert with_cache["ppl"] == pytest.approx(plain["ppl"], rel=1e-6)
    assert with_cache["cache_bytes"] > 0


@pytest.mark.parametrize("kwargs, match", [
    ({}, "exactly one"),
    ({"text": "a b", "windows": torch.zeros(1, 4, dtype=torch.long)}, "exactly one"),
    ({"windows": torch.zeros(4, dtype=torch.long)}, "shape"),
    ({"windows": torch.zeros(2, 4)}, "integer"),
    ({"text": ""}, "non-empty"),
])
def test_evaluate_text_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        palu.evaluate_text(tiny_llama(0), tiny_tokenizer(), progress=False, **kwargs)


def test_the_readme_names_resolve_after_import_palu():
    """What the README calls after `import palu` alone: the sweep statistics from palu.calib, LoRA
    recovery from palu.recover, the allocator orchestration and the suite registry."""
    import subprocess
    import sys
    code = ("import palu; palu.calib.collect_grams; palu.calib.collect_fisher; palu.calib.FisherWindows; "
            "palu.recover.recover; palu.recover.LoraRecovery; "
            "from palu.decompose.allocation import allocate_ranks; from palu.eval.suites import SUITES; "
            "assert set(SUITES) >= {'needles', 'qasper', 'longbench', 'ruler'}")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_calibration_windows_at_explicit_offsets_match_another_codes_draw():
    """`offsets=` starts one window at each given token offset (how a user reproduces another
    code's calibration, e.g. Python's `random.randint` draw over the joined text); a start where
    no whole window fits, a negative or a non-integer one is refused naming it."""
    import random
    tok = tiny_tokenizer()
    ids = torch.tensor(tok(TEXT, add_special_tokens=False)["input_ids"])
    random.seed(0)
    starts = [random.randint(0, ids.numel() - 16 - 1) for _ in range(4)]
    windows = palu.calibration_data(tok, text=TEXT, seqlen=16, offsets=starts, bos="never")
    assert torch.equal(windows, torch.stack([ids[s: s + 16] for s in starts]))
    last = ids.numel() - 16
    assert palu.calibration_data(tok, text=TEXT, seqlen=16, offsets=[last], bos="never").shape == (1, 16)
    for bad in ([last + 1], [-1], [2.5], []):
        with pytest.raises(ValueError, match="offset"):
            palu.calibration_data(tok, text=TEXT, seqlen=16, offsets=bad, bos="never")


def test_progress_lines_reach_stderr_without_logging_and_a_bad_mode_is_refused(capsys):
    """progress="lines": a line every ~10% on stderr when no logging shows the palu logger (a
    script or notebook that configured nothing); False: nothing printed; an unknown mode fails."""
    from palu.progress import steps
    assert list(steps(range(20), "work", "items", progress="lines")) == list(range(20))
    err = capsys.readouterr().err
    assert "work: 20/20 items" in err and len(err.splitlines()) == 10
    assert list(steps(range(20), "work", "items", progress=False)) == list(range(20))
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError, match="progress='bars'"):
        list(steps(range(3), "work", "items", progress="bars"))
