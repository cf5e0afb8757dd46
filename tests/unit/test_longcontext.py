"""Long-context (needle) evaluation: answers come from the method's cache (decode-time, never a
recompute from full K/V), samples hide their needles where asked, scoring parses numbers, bad
settings fail early."""
import copy

import pytest
import torch

import palu
from palu.eval.generation import answer
from palu.eval.needles import KINDS, make_samples, score
from palu.methods import build_method
from tiny import WORDS, tiny_llama, tiny_tokenizer


def _palu_method(tmp_path, bits):
    base = tiny_llama(0).double()
    calib = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(0))
    palu.compress(copy.deepcopy(base), calib, kept_ratio=0.5, group_size=1, multiple=8, progress=False).save(tmp_path / f"c{bits}")
    method = build_method({"name": "palu", "checkpoint": str(tmp_path / f"c{bits}"), "latent_bits": bits})
    model = copy.deepcopy(base)
    method.install(model)
    return model, method


def _poison(cache) -> int:
    """Zero every stored token tensor of a filled cache (codes, scales, norms, latents), walking
    its layers' attributes; the codecs (rotations, codebooks) and positions are left alone."""
    def walk(obj, depth):
        if isinstance(obj, torch.Tensor):
            if obj.is_floating_point() or obj.dtype == torch.uint8:
                obj.zero_()
                return 1
            return 0
        if depth > 4:
            return 0
        items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) \
            else vars(obj).items() if hasattr(obj, "__dict__") else ()
        return sum(walk(v, depth + 1) for k, v in items if k not in ("codec", "positions", "_positions"))
    return sum(walk(layer, 0) for layer in cache.layers)


@torch.no_grad()
def _decode_from_cache(model, method, prompt, steps, poison=False):
    """Prefill into the method's cache, then feed only each new token: the prompt is reachable
    through the cache alone."""
    cache = method.make_cache(model)
    logits = model(prompt, past_key_values=cache, use_cache=True).logits[:, -1]
    if poison:
        assert _poison(cache) > 0
    out = []
    for _ in range(steps):
        nxt = logits.argmax(-1, keepdim=True)
        out.append(int(nxt))
        logits = model(nxt, past_key_values=cache, use_cache=True).logits[:, -1]
    return out


@pytest.mark.parametrize("which", ["palu-2bit", "turboquant-3"])
def test_answers_come_from_the_compressed_cache(tmp_path, which):
    tok = tiny_tokenizer()
    if which == "palu-2bit":
        model, method = _palu_method(tmp_path, 2)
    else:
        model, method = tiny_llama(0).double(), build_method({"name": "turboquant", "bits": 3})
        method.install(model)
    words = [w for w in dict.fromkeys(WORDS)][3:60]
    prompt_ids = tok(" ".join(words * 3))["input_ids"][:120]
    prompt = torch.tensor([prompt_ids])
    steps = 8
    generated = tok(answer(model, tok, method, prompt_ids, max_new_tokens=steps))["input_ids"]
    through_cache = _decode_from_cache(model, method, prompt, steps)
    # generate() through the method's cache is exactly prefill + one token at a time
    assert tok.decode(through_cache) == tok.decode(generated)
    # the answer depends on what the cache stores: poisoned after prefill, it changes
    assert _decode_from_cache(model, method, prompt, steps, poison=True) != through_cache


def test_the_quantised_cache_is_what_the_answer_reads(tmp_path):
    prompt = torch.randint(3, 97, (1, 96), generator=torch.Generator().manual_seed(4))
    m16, method16 = _palu_method(tmp_path, 16)
    m2, method2 = _palu_method(tmp_path, 2)
    with torch.no_grad():
        a = m16(prompt, past_key_values=method16.make_cache(m16), use_cache=True).logits[:, -1]
        b = m2(prompt, past_key_values=method2.make_cache(m2), use_cache=True).logits[:, -1]
    assert (a - b).abs().max().item() > 1e-3


def test_samples_hide_their_needles_and_scoring_parses_numbers():
    tok = tiny_tokenizer()
    filler = ". ".join(" ".join(WORDS[i:i + 8]) for i in range(0, 400, 8)) + "."
    samples = make_samples(tok, filler * 4, KINDS, [300], [0.0, 1.0], seed=1)
    assert len(samples) == len(KINDS) * 2
    for s in samples:
        assert all(n in s.context for n in s.needles) and all(a in " ".join(s.needles) for a in s.answers)
    first, last = samples[2], samples[3]                    # single needle at depth 0 and 1
    assert first.context.startswith(first.needles[0]) and last.context.rstrip().endswith(last.needles[0])
    assert score("It is 1234567.", ["1234567"]) == 1.0 and score("no idea", ["1234567"]) == 0.0
    assert score("1111111 and 2222222", ["1111111", "2222222", "3333333"]) == pytest.approx(2 / 3)
    assert score("12345678", ["1234567"]) == 0.0          # digits must match as a whole number


def test_bad_long_context_settings_fail_early():
    tok = tiny_tokenizer()
    filler = " ".join(WORDS) + "."
    with pytest.raises(ValueError, match="unknown"):
        make_samples(tok, filler, ["haystack"], [64], [0.5])
    with pytest.raises(ValueError, match="exceeds the model's maximum context"):
        make_samples(tok, filler, ["single"], [9000], [0.5], max_positions=8192)
    with pytest.raises(ValueError, match="depths"):
        make_samples(tok, filler, ["single"], [64], [1.5])


def _lc_result(tmp_path, method, scores):
    samples = [{"kind": "single", "length": n, "depth": d, "question": "q", "needles": ["x"], "answers": ["1"],
                "prompt_tokens": n, "answer": "1" if s else "", "score": s}
               for (n, d), s in zip([(512, 0.0), (512, 1.0), (1024, 0.0), (1024, 1.0)] * 5, scores)]
    path = tmp_path / f"{method}.json"
    import json
    path.write_text(json.dumps({"longcontext": {"samples": samples}, "summary": {"model": "m", "method": method}}))
    return str(path)


def test_the_long_context_table_and_heatmap(tmp_path):
    from palu.eval.stats import paired_difference
    from palu.pipeline.reporting.longcontext_table import longcontext_frame, needle_heatmap, to_markdown, _load
    paths = [_lc_result(tmp_path, "fp16", [1.0] * 20), _lc_result(tmp_path, "bad", [0.0] * 20),
             _lc_result(tmp_path, "two", [1.0] * 18 + [0.0] * 2)]
    frame = longcontext_frame(paths).set_index(["method", "task"])
    assert frame.loc[("bad", "needles"), "significant"] and frame.loc[("bad", "needles"), "score"] == 0
    assert not frame.loc[("two", "needles"), "significant"]   # two changed answers: sign test p = 0.5
    assert frame.loc[("fp16", "needles_L512"), "score"] == 1.0
    assert frame.loc[("two", "needles_L1024"), "score"] == 0.8
    assert "| two | 16 |" in to_markdown(longcontext_frame(paths), _load(paths))
    assert not paired_difference([0.0, 0.0], [1.0, 1.0])["significant"]   # zero-width bootstrap, n=2
    needle_heatmap(paths, tmp_path / "h.png")
    assert (tmp_path / "h.png").stat().st_size > 5_000
    with pytest.raises(ValueError, match="different samples"):
        longcontext_frame([paths[0], _lc_result(tmp_path, "short", [1.0] * 8)])


BATCH_METHODS = {"fp16": {"name": "fp16"},
                 "snapkv": {"name": "snapkv", "compression_ratio": 0.5, "window": 2, "kernel": 1},
                 "h2o": {"name": "h2o", "budget": 48, "window": 8},
                 "kivi": {"name": "kivi", "bits": 2, "group": 4, "residual": 8}}


@pytest.mark.parametrize("which", ["fp16", "palu-4bit", "snapkv", "h2o", "kivi"])
def test_a_suite_answers_at_batch_4_as_at_batch_1(tmp_path, which):
    """Float64: the needle suite and the document suites (prompts of different lengths and answer
    lengths, several tasks) give the same result at batch 4 as one prompt at a time — answers,
    scores, intervals and bytes (an eviction row's own bytes). SnapKV and H2O batch row by row;
    KIVI keeps a padded batch's rows apart."""
    from palu.eval.documents import Document, evaluate_documents
    from palu.eval.needles import evaluate_needles
    tok = tiny_tokenizer()
    if which == "palu-4bit":
        model, method = _palu_method(tmp_path, 4)
    else:
        model = tiny_llama(0).double()
        method = build_method(BATCH_METHODS[which])
        method.install(model)
    filler = ". ".join(" ".join(WORDS[i:i + 8]) for i in range(0, 400, 8)) + "."
    samples = make_samples(tok, filler * 4, KINDS[:2], [90, 150], [0.0, 0.5, 1.0], seed=2)
    one = evaluate_needles(model, tok, method, samples, max_new_tokens=6)
    assert evaluate_needles(model, tok, method, samples, max_new_tokens=6, batch_size=4) == one
    words = list(dict.fromkeys(WORDS))[3:]
    docs = [Document(f"task{i % 2}", str(i), "{context} question", " ".join(words[i:i + 20 + 9 * i]),
                     [words[i + 2]], "string_match_all", 3 + 2 * (i % 2), chat=False) for i in range(7)]
    one = evaluate_documents(model, tok, method, docs, 200)
    assert evaluate_documents(model, tok, method, docs, 200, batch_size=4) == one
    assert len({r["prompt_tokens"] for r in one["samples"]}) == 7


def test_a_stopped_suite_resumes_from_its_journal_and_answers_the_same(tmp_path, monkeypatch):
    """A job stopped after its first batch (a time limit, a preemption) and run again answers only
    the prompts its journal lacks, and its answers equal an uninterrupted run's; a journal of
    other settings is refused by name; a line cut short by the kill is ignored."""
    from palu.eval import generation
    from palu.eval.documents import Document, evaluate_documents
    from palu.eval.journal import answer_journal
    tok = tiny_tokenizer()
    model = tiny_llama(0).double()
    method = build_method(BATCH_METHODS["kivi"])
    method.install(model)
    words = list(dict.fromkeys(WORDS))[3:]
    docs = [Document(f"task{i % 2}", str(i), "{context} question", " ".join(words[i:i + 20 + 9 * i]),
                     [words[i + 2]], "string_match_all", 3 + 2 * (i % 2), chat=False) for i in range(7)]
    whole = evaluate_documents(model, tok, method, docs, 200, batch_size=2)
    answered = []
    real = generation._generate

    def counting(model, tokenizer, method, prompts, new):
        answered.extend(map(tuple, prompts))
        return real(model, tokenizer, method, prompts, new)
    monkeypatch.setattr(generation, "_generate", counting)

    class Stop(Exception):
        pass

    def stop_after_first(done, total):
        raise Stop
    path, fingerprint = tmp_path / "journal.jsonl", {"method": method.tag, "suite": "docs"}
    with answer_journal(path, fingerprint), pytest.raises(Stop):
        generation.answer_batches(model, tok, method, [list(range(3, 10 + i)) for i in range(5)], 4,
                                  batch_size=2, progress=stop_after_first)
    with path.open("a") as f:
        f.write('{"key": "cut sh')                      # the kill's half-written line
    first = len(answered)
    assert first == 2
    with answer_journal(path, fingerprint) as journal:
        assert len(journal) == 2
        again = generation.answer_batches(model, tok, method, [list(range(3, 10 + i)) for i in range(5)],
                                          4, batch_size=2)
    assert len(answered) == first + 3                    # only the three not journaled
    monkeypatch.setattr(generation, "_generate", real)
    assert again == generation.answer_batches(model, tok, method, [list(range(3, 10 + i)) for i in range(5)],
                                              4, batch_size=1)
    # a whole suite through a journal, stopped and resumed, equals the uninterrupted run
    path2 = tmp_path / "suite.jsonl"
    with answer_journal(path2, fingerprint):
        assert evaluate_documents(model, tok, method, docs, 200, batch_size=3) == whole
    with answer_journal(path2, fingerprint):
        assert evaluate_documents(model, tok, method, docs, 200, batch_size=1) == whole
    with pytest.raises(ValueError, match="other settings"):
        with answer_journal(path2, {"method": "kivi-b4", "suite": "docs"}):
            pass


def test_a_journal_knows_the_weights_by_their_source(tmp_path):
    """A folder `prepare` made is named by the GGUF it was made from (prepared again on the next
    GPU lease, it is the same model); another GGUF's content is another model."""
    import json
    import os
    from palu.pipeline.cli.longcontext import weights_signature
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    folder = tmp_path / "prepared"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "palu_source.json").write_text(json.dumps({"model_id": str(gguf)}))
    first = weights_signature(str(folder))
    os.utime(folder / "config.json", ns=(1, 1))                 # prepared again: other file times
    assert weights_signature(str(folder)) == first == {"prepared_from": str(gguf), **weights_signature(str(gguf))}
    gguf.write_bytes(b"GGUF" + bytes(99) + b"x")                # other weights
    assert weights_signature(str(folder)) != first
    (folder / "palu_source.json").unlink()                      # a folder of one's own: its files
    assert set(weights_signature(str(folder))) == {"config.json"}


def test_a_journal_fingerprint_holds_what_made_the_answers_not_how_long_it_took():
    """A checkpoint decomposed again (a fresh GPU host: the same factors, another duration) must
    resume its journal; other factors must not."""
    from palu.pipeline.cli.longcontext import without_timings
    first = {"name": "palu", "manifest": {"files": {"factors.safetensors": "1e4f"},
                                          "settings": {"decompose_seconds": 1.14, "samples": 24},
                                          "summary": {"decompose_seconds": 1.14}, "ranks": [{"rank": 96}]}}
    again = {**first, "manifest": {**first["manifest"], "settings": {"decompose_seconds": 1.09, "samples": 24},
                                   "summary": {"decompose_seconds": 1.09}}}
    other = {**first, "manifest": {**first["manifest"], "files": {"factors.safetensors": "9a0c"}}}
    assert without_timings(first) == without_timings(again)
    assert without_timings(first) != without_timings(other)
    assert without_timings(first)["manifest"]["settings"] == {"samples": 24}
