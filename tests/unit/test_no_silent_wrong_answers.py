"""Issue 20: each way a wrong number (or a lost result) used to come out silently, now an error
or a correct number. Tiny random models and a tiny word-level tokenizer; no embedded model."""
import copy
import json
import logging

import pytest
import torch

import palu
from palu.decompose.lineage import lineage_of
from palu.cache.latent_cache import LatentCache
from palu.data.windows import bos_token_for, calibration_windows, evaluation_windows
from palu.artifacts import NonFiniteResultError, write_json
from palu.models.adapters import UnsupportedArchitectureError, sliding_window_of
from tiny import (save_tiny, tiny_gemma2, tiny_gpt2, tiny_llama, tiny_mistral_sliding, tiny_qwen2_sliding,
                  tiny_tokenizer)


# ---- 1. BOS ------------------------------------------------------------------------------------
def test_windows_start_with_bos_where_the_tokenizer_adds_one():
    tokens = torch.arange(3, 43)
    bos = bos_token_for(tiny_tokenizer(add_bos=True), "auto")
    assert bos == 1
    w = evaluation_windows(tokens, 10, bos=bos)
    assert w.shape == (4, 10) and (w[:, 0] == 1).all()
    assert torch.equal(w[:, 1:].flatten(), tokens[:36])          # BOS + 9 text tokens, no overlap
    c = calibration_windows(tokens, 3, 10, seed=0, bos=bos)
    assert c.shape == (3, 10) and (c[:, 0] == 1).all()


def test_a_tokenizer_without_bos_gives_the_windows_of_before():
    """SmolLM2's tokenizer adds no BOS: `auto` must leave its windows (and numbers) as they were
    (tests/integration checks the real tokenizer resolves to None)."""
    tokens = torch.arange(100)
    tok = tiny_tokenizer(add_bos=False)
    assert bos_token_for(tok, "auto") is None
    assert torch.equal(evaluation_windows(tokens, 16, bos=None), tokens[:96].view(6, 16))
    gen = torch.Generator().manual_seed(5)
    starts = torch.randint(0, 100 - 16, (4,), generator=gen).tolist()
    assert torch.equal(calibration_windows(tokens, 4, 16, 5),
                       torch.stack([tokens[s:s + 16] for s in starts]))


def test_bos_settings_always_and_never_override_the_tokenizer():
    assert bos_token_for(tiny_tokenizer(add_bos=False), "always") == 1
    assert bos_token_for(tiny_tokenizer(add_bos=True), "never") is None
    with pytest.raises(ValueError, match="bos='sometimes'"):
        bos_token_for(tiny_tokenizer(), "sometimes")


def test_evaluation_records_the_bos_choice_and_bos_changes_the_number():
    from palu.eval.runner import evaluate_corpus
    model, tok = tiny_llama(0), tiny_tokenizer(add_bos=True)
    runs = {b: evaluate_corpus(model, tok, "wiki_standin", 32, 128, progress=False, bos=b)
            for b in ("auto", "never")}
    assert runs["auto"]["bos_token_id"] == 1 and runs["never"]["bos_token_id"] is None
    assert runs["auto"]["bos"] == "auto"
    assert runs["auto"]["ppl"] != runs["never"]["ppl"]


# ---- 2. prepare round trip ---------------------------------------------------------------------
def test_prepare_checks_the_tokenizer_and_logits_after_reloading(tmp_path, monkeypatch):
    from palu.models import loading
    src = save_tiny(tiny_llama(0), tiny_tokenizer(), tmp_path / "src")
    loading.prepare_model(str(src), tmp_path / "good")            # a faithful copy passes
    assert (tmp_path / "good" / "config.json").is_file()

    def character_tokenizer(tok, folder):   # what the Gemma-3 GGUF conversion did on save
        broken = copy.deepcopy(tok)
        broken.backend_tokenizer.pre_tokenizer = __import__("tokenizers").pre_tokenizers.Split("", "isolated")
        broken.save_pretrained(folder)
    monkeypatch.setattr(loading, "_save_tokenizer", character_tokenizer)
    with pytest.raises(loading.PreparedModelMismatchError, match="does not tokenise like the source"):
        loading.prepare_model(str(src), tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_prepare_keeps_a_safetensors_models_own_dtype(tmp_path):
    """A float16 checkpoint is prepared as float16 (a float32 copy of a 7B model doubled its disk
    and host memory), bit for bit."""
    from safetensors.torch import load_file
    from palu.models import loading
    src = save_tiny(tiny_llama(0).half(), tiny_tokenizer(), tmp_path / "src")
    loading.prepare_model(str(src), tmp_path / "prepared")
    a, b = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "prepared" / "model.safetensors"))
    assert {t.dtype for t in b.values()} == {torch.float16}
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_prepare_refuses_a_copy_with_other_logits(tmp_path, monkeypatch):
    from palu.models import loading
    model, tok = tiny_llama(0), tiny_tokenizer()
    folder = save_tiny(copy.deepcopy(model), tok, tmp_path / "copy")
    with torch.no_grad():
        model.lm_head.weight.add_(0.01)
    with pytest.raises(loading.PreparedModelMismatchError, match="other weights than the source: lm_head.weight differs"):
        loading.check_round_trip(model, tok, folder)


def test_prepare_refuses_a_copy_with_another_config_or_other_logits(tmp_path, monkeypatch):
    """The same weights under another config (the norms' epsilon) are refused by the config comparison;
    and where a copy computes otherwise with every weight and setting equal (here: the reloaded
    model's attention made to scale its scores), by its logits."""
    import json
    from palu.models import loading
    model, tok = tiny_llama(0), tiny_tokenizer()
    folder = save_tiny(copy.deepcopy(model), tok, tmp_path / "copy")
    loading.check_round_trip(model, tok, folder)                     # the faithful copy passes
    config = json.loads((folder / "config.json").read_text())
    config["rms_norm_eps"] = 0.5
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(loading.PreparedModelMismatchError, match="another config than the source: rms_norm_eps=0.5"):
        loading.check_round_trip(model, tok, folder)
    folder = save_tiny(copy.deepcopy(model), tok, tmp_path / "copy2")
    from transformers import AutoModelForCausalLM
    real = AutoModelForCausalLM.from_pretrained

    def louder(*args, **kwargs):
        m = real(*args, **kwargs)
        with torch.no_grad():
            m.model.norm.weight.mul_(1.01)   # differs after loading: not in the weights compared
        m.state_dict = model.state_dict      # (the comparison sees the source's weights)
        return m
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", louder)
    with pytest.raises(loading.PreparedModelMismatchError, match="other logits"):
        loading.check_round_trip(model, tok, folder)


# ---- 3. unsupported families -------------------------------------------------------------------
def test_an_unsupported_family_is_refused_at_load_compress_and_cache(tmp_path):
    folder = save_tiny(tiny_gpt2(), tiny_tokenizer(add_bos=True), tmp_path / "gpt2")
    for call in (lambda: palu.load_model(str(folder)),
                 lambda: palu.models.loading.load_config(str(folder)),
                 lambda: palu.compress(tiny_gpt2(), torch.randint(0, 97, (2, 16)), progress=False)):
        with pytest.raises(UnsupportedArchitectureError, match=r"'gpt2' is not supported; "
                                                               r"supported families: \[.*'llama'"):
            call()
    with pytest.raises(ValueError, match="no Palu attention"):
        LatentCache(tiny_gpt2())


def test_attention_logit_softcapping_is_refused_by_name(tmp_path):
    """Gemma-2 soft-caps attention logits; SDPA does not, so every attention palu installs would
    drop it silently: refused at load and by every method, naming the setting."""
    from palu.methods import build_method
    folder = save_tiny(tiny_gemma2(), tiny_tokenizer(add_bos=True), tmp_path / "gemma2")
    for call in (lambda: palu.load_model(str(folder)),
                 lambda: palu.compress(tiny_gemma2(), torch.randint(0, 97, (2, 16)), progress=False),
                 lambda: build_method({"name": "kivi", "bits": 2}).install(tiny_gemma2())):
        with pytest.raises(UnsupportedArchitectureError, match="attn_logit_softcapping=50.0"):
            call()


# ---- 4. sliding windows ------------------------------------------------------------------------
def _full_rank(base):
    model = copy.deepcopy(base)
    palu.compress(model, None, kept_ratio=1.0, decomposition="plain", progress=False)
    return model


@pytest.mark.parametrize("make", [tiny_mistral_sliding, tiny_qwen2_sliding])
def test_a_sliding_window_cache_is_refused(make):
    """transformers' DynamicSlidingWindowLayer trimmed the latents while Palu assumed positions
    0..S-1: 13 of 20 greedy tokens differed past the window. Now a clear error."""
    model = _full_rank(make().double())
    assert sliding_window_of(model.config) == 8
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(3))
    with pytest.raises(TypeError, match="DynamicSlidingWindowLayer.*palu.LatentCache"):
        model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("make", [tiny_mistral_sliding, tiny_qwen2_sliding])
def test_the_latent_cache_honours_the_window(make):
    """Decoding far past the window through LatentCache: every step's logits equal the
    uncompressed model with its own sliding-window cache (float64, full rank)."""
    from transformers import DynamicCache
    base = make().double()
    model = _full_rank(base)
    ids = torch.randint(0, 97, (1, 30), generator=torch.Generator().manual_seed(3))
    ref_cache, cache = DynamicCache(config=base.config), LatentCache(model)
    with torch.no_grad():
        diffs = [(base(ids[:, :12], past_key_values=ref_cache).logits
                  - model(ids[:, :12], past_key_values=cache).logits).abs().max()]
        for t in range(12, 30):
            diffs.append((base(ids[:, t:t + 1], past_key_values=ref_cache).logits
                          - model(ids[:, t:t + 1], past_key_values=cache).logits).abs().max())
    assert max(diffs) < 1e-9
    out = model.generate(ids[:, :5], max_new_tokens=20, do_sample=False, pad_token_id=0,
                         past_key_values=LatentCache(model))
    assert torch.equal(out, base.generate(ids[:, :5], max_new_tokens=20, do_sample=False, pad_token_id=0))


def test_the_graph_cache_refuses_a_sliding_window():
    from palu.cache.graph_cache import GraphLatentCache
    with pytest.raises(ValueError, match="no sliding-window attention"):
        GraphLatentCache(_full_rank(tiny_mistral_sliding()), max_tokens=32)


def test_a_plain_dynamic_cache_still_works_without_a_window():
    model = _full_rank(tiny_llama(0).double())
    ids = torch.randint(0, 97, (1, 6))
    a = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    b = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0,
                       past_key_values=LatentCache(model))
    assert torch.equal(a, b)


# ---- 5. NaN never written ----------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_metric_writers_refuse_non_finite_values(tmp_path, bad):
    out = tmp_path / "m.json"
    with pytest.raises(NonFiniteResultError, match=r"metrics\.ppl"):
        write_json(out, {"metrics": {"ppl": bad, "tokens": 3}})
    assert list(tmp_path.iterdir()) == []


def test_tables_refuse_a_non_finite_run(tmp_path):
    from palu.pipeline.reporting.tables import build_table
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"metrics": {"model": "m", "method": "fp16", "corpus": "c",
                                           "corpus_label": "c", "seqlen": 8, "tokens": 8,
                                           "ppl": float("nan")}}))
    with pytest.raises(ValueError, match="is not a finite number"):
        build_table([str(run)])


# ---- 6. result paths ---------------------------------------------------------------------------
def _manifest(samples=24, method="uniform"):
    return {"tag": "palu-whitened-uniform-k0.5-g1", "files": {"factors.safetensors": "ab" * 32},
            "allocation": {"method": method, "multiple": 8},
            "settings": {"calibration": {"corpus": "wiki_standin", "samples": samples,
                                         "seqlen": 2048, "seed": 0, "bos": "auto"},
                         "fisher": {"samples": 8, "seqlen": 2048, "seed": 1},
                         "calibration_dtype": "float32"}}


def test_result_paths_name_the_calibration_and_every_evaluation_setting():
    """A checkpoint calibrated on 2 samples replaced the committed result of 24 (52.22 -> 75.74):
    the calibration was not in the path. Now every setting that changes the number is."""
    from palu.pipeline import naming

    def path(manifest, **kw):
        run = naming.run_name(manifest["tag"], lineage_of(manifest))
        args = dict(dtype="float32", calibration_fraction=0.3, bos="auto") | kw
        return naming.metrics_path("results", "m", run, "wiki_standin", 2048, 8192, **args)
    base = path(_manifest())
    variants = [path(_manifest(samples=2)), path(_manifest(method="fisher")),
                path(_manifest(), dtype="bfloat16"), path(_manifest(), calibration_fraction=0.5),
                path(_manifest(), bos="always")]
    assert len({base, *variants}) == 6
    # a library-saved checkpoint has no named calibration: its factors' hash names it
    bare = {**_manifest(), "settings": {}}
    assert lineage_of(bare) == ("checkpoint-" + "ab" * 6,)


def test_the_grid_names_a_run_as_its_checkpoint_will():
    """The Snakefile's result path (from the grid) and evaluate's (from the manifest the decompose
    step writes) are one function of the same settings."""
    from palu.pipeline import naming
    from palu.pipeline.grid import Grid, PaluSpec
    grid = Grid.load("conf/grid/default.yaml")
    spec = PaluSpec("whitened", "uniform", 0.5, 1)
    m = _manifest()
    assert grid.run_name(spec) == naming.run_name(spec.tag, lineage_of(m))


def test_an_evaluation_by_hand_writes_under_the_work_folder():
    from palu.pipeline.config import validate
    from palu.methods import build_method
    from palu.pipeline import naming
    from omegaconf import OmegaConf
    cfg = validate(OmegaConf.create({"model": {"name": "m", "id": "x"}, "paths": {"work": "w", "results": "r"}}))
    path = naming.metrics_path_of(cfg, build_method({"name": "fp16"}))
    assert str(path).startswith("w/results/runs/m/fp16/ppl-wiki_standin-L2048-Tall-float32-cf0.3")


# ---- 7. paths the stand-ins cannot take --------------------------------------------------------
@pytest.mark.parametrize("section", ["data", "calibration"])
def test_a_path_for_an_embedded_corpus_is_refused(section):
    from omegaconf import OmegaConf

    from palu.pipeline.config import ConfigError, validate
    cfg = OmegaConf.create({"model": {"name": "m", "id": "x"}, section: {"path": "/my/wiki"}})
    with pytest.raises(ConfigError, match=rf"{section}.path='/my/wiki' cannot be used"):
        validate(cfg)
    from palu.data.corpora import load_corpus
    with pytest.raises(ValueError, match="is embedded and takes no path"):
        load_corpus("novels_standin", path="/my/wiki")


# ---- 8. smaller ones ---------------------------------------------------------------------------
def test_a_latent_cache_on_an_uncompressed_model_is_refused():
    with pytest.raises(ValueError, match="no Palu attention"):
        LatentCache(tiny_llama(0))
    LatentCache(num_layers=2)   # a cache for a model given later stays possible


def test_progress_off_still_logs_a_line_per_tenth(caplog):
    from palu.eval.perplexity import perplexity
    windows = torch.randint(0, 97, (20, 8))
    with caplog.at_level(logging.INFO, logger="palu"):
        perplexity(tiny_llama(0), windows, progress=False)
    lines = [r.message for r in caplog.records if r.message.startswith("perplexity:")]
    assert len(lines) == 10 and lines[-1].startswith("perplexity: 20/20 windows")


def test_a_rerun_resumes_its_wandb_run():
    from palu.pipeline.tracking.wandb_run import run_id
    assert run_id("p", "evaluate", "m/fp16/x") == run_id("p", "evaluate", "m/fp16/x")
    assert run_id("p", "evaluate", "m/fp16/x") != run_id("p", "evaluate", "m/fp16/y")


def test_a_table_refuses_two_runs_under_one_label(tmp_path):
    from palu.pipeline.reporting.tables import build_table
    paths = []
    for i, ppl in enumerate((5.0, 6.0)):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps({"metrics": {"model": "m", "method": "fp16", "corpus": "c",
                                                     "corpus_label": "c", "seqlen": 8, "tokens": 8,
                                                     "dtype": "float32", "ppl": ppl}}))
    with pytest.raises(ValueError, match="same"):
        build_table([str(p) for p in paths])


def test_gguf_tokenizers_get_back_the_bos_and_eos_their_metadata_name(monkeypatch):
    """Issue 20.1 / 20.8: transformers' GGUF conversion dropped Gemma-3's add_bos_token=true
    (so `bos: auto` added none: ppl 410 instead of 129 by hand) and named SmolLM2's EOS 1
    where the metadata and the model config say 2."""
    from palu.models import loading
    tok, model = tiny_tokenizer(add_bos=False), tiny_llama(0)
    model.config.eos_token_id = 3
    monkeypatch.setattr(loading, "_gguf_flag", lambda path, key: True)
    loading._align_tokenizer(tok, model, "model.gguf")
    assert bos_token_for(tok, "auto") == 1
    assert tok.eos_token_id == 3
