"""Long-document suites: LongBench's official metrics against hand-computed values, the THUDM and
RULER file loaders on fixtures written in those formats, the embedded Qasper papers, prompt
truncation, and answers generated through a method's cache."""
import json

import pytest
import torch

from palu.eval import scorers
from palu.eval.documents import Document, evaluate_documents, prompt_ids
from palu.eval.longbench import TASKS, load_longbench
from palu.eval.qasper import load_qasper
from palu.eval.ruler import load_ruler
from palu.methods import build_method
from tiny import WORDS, tiny_llama, tiny_tokenizer


def test_longbench_scorers_match_hand_computed_values():
    # normalised "cat sat on mat" vs "cat on mat": 3 shared of 4 / 3 tokens -> F1 = 2*.75*1/1.75
    assert scorers.qa_f1("The cat sat on a mat.", "cat on mat") == pytest.approx(6 / 7)
    assert scorers.qa_f1("dog", "cat") == 0.0
    # the rouge package (LongBench's) counts distinct words of the union LCS: {the, cat, on, mat}
    # = 4 of the 5 distinct words on each side -> P = R = F = 0.8 (not 5/6 as token counts give)
    assert scorers.rouge_l("the cat sat on the mat", "the cat was on the mat") == pytest.approx(0.8, abs=1e-6)
    assert scorers.rouge_l("", "the reference") == 0.0
    classes = ["LOC", "NUM", "HUM"]
    assert scorers.classification("LOC or NUM", "LOC", all_classes=classes) == 0.5
    assert scorers.classification("HUM", "LOC", all_classes=classes) == 0.0
    # "Loc" is only part of the reference "Location": not counted as a second named class
    assert scorers.classification("Location", "Location", all_classes=["Location", "Loc"]) == 1.0
    assert scorers.retrieval("Paragraph 12, or maybe 3", "Paragraph 12") == 0.5
    assert scorers.count("There are 7 different paragraphs", "7") == 1.0
    assert scorers.count("7 or 8", "7") == 0.5 and scorers.count("none", "7") == 0.0
    # first line without a comment marker; 12 of 13 characters match: round(100 * 24/26) = 92
    assert scorers.code_sim("\n# comment\nx = foo(a, b)\nmore", "x = foo(a, c)") == 0.92
    assert scorers.code_sim("```\n", "x = 1") == 0.0
    assert scorers.yes_no("Yes, it does.", "Yes") == 1.0 and scorers.yes_no("I think no.", "Yes") == 0.0
    assert scorers.yes_no("Unclear.", "No") == 0.0 and scorers.yes_no("nothing", "No") == 0.0
    assert scorers.string_match_all("numbers 123 and 456", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert scorers.string_match_part("numbers 123 and 456", ["789", "456"]) == 1.0
    # a sample scores its best reference
    assert scorers.score("qa_f1", "The cat sat on a mat.", ["dog", "cat on mat"]) == pytest.approx(6 / 7)
    with pytest.raises(ValueError, match="unknown"):
        scorers.score("bleu", "x", ["x"])


def _write_longbench(folder, tasks=("hotpotqa", "trec", "lcc"), n=3):
    folder.mkdir(exist_ok=True)
    for task in tasks:
        rows = [{"input": f"question {i}?", "context": " ".join(WORDS[i:i + 60]), "answers": [f"the answer {i}"],
                 "length": 60, "dataset": task, "language": "en",
                 "all_classes": ["LOC", "NUM"] if task == "trec" else None, "_id": f"{task}-{i}"}
                for i in range(n)]
        (folder / f"{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_longbench_loader_reads_the_thudm_format(tmp_path):
    folder = _write_longbench(tmp_path / "lb")
    docs = load_longbench(str(folder), ["hotpotqa", "trec", "lcc"], limit=2)
    assert [d.task for d in docs] == ["hotpotqa"] * 2 + ["trec"] * 2 + ["lcc"] * 2
    trec = docs[2]
    assert trec.metric == "classification" and trec.all_classes == ["LOC", "NUM"]
    assert not trec.chat and trec.first_line and trec.max_new_tokens == TASKS["trec"].max_new_tokens
    assert docs[0].answers == ["the answer 0"] and docs[0].id == "hotpotqa-0"
    assert docs[4].metric == "code_sim" and not docs[4].chat
    prompts = tmp_path / "dataset2prompt.json"
    prompts.write_text(json.dumps({"hotpotqa": "P: {context} Q: {input} A:"}))
    own = load_longbench(str(folder), ["hotpotqa"], limit=1, prompts=str(prompts))[0]
    assert own.template.format(context="c", **own.fields) == "P: c Q: question 0? A:"


def test_longbench_bad_input_names_the_problem(tmp_path):
    folder = _write_longbench(tmp_path / "lb", tasks=("hotpotqa",))
    with pytest.raises(FileNotFoundError, match="missing LongBench files .*qmsum.jsonl, trec.jsonl"):
        load_longbench(str(folder), ["hotpotqa", "qmsum", "trec"])
    with pytest.raises(ValueError, match="dir is not set"):
        load_longbench(None, ["hotpotqa"])
    with pytest.raises(ValueError, match="Chinese"):
        load_longbench(str(folder), ["dureader"])
    with pytest.raises(ValueError, match=r"\['wikiqa'\] unknown"):
        load_longbench(str(folder), ["wikiqa"])
    with pytest.raises(ValueError, match="limit must be positive"):
        load_longbench(str(folder), ["hotpotqa"], limit=0)
    (folder / "musique.jsonl").write_text(json.dumps({"input": "q", "answers": ["a"]}) + "\n")
    with pytest.raises(ValueError, match=r"musique.jsonl:1 lacks LongBench fields \['context'\]"):
        load_longbench(str(folder), ["musique"])


def test_ruler_loader_and_its_never_cut_prompts(tmp_path):
    for task in ("niah_single_1", "qa_1"):
        (tmp_path / task).mkdir()
        rows = [{"index": i, "input": " ".join(WORDS[:50]) + " what is it?", "outputs": ["42", "43"],
                 "length": 52, "answer_prefix": " Answer:"} for i in range(2)]
        (tmp_path / task / "validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    docs = load_ruler(str(tmp_path), ["niah_single_1", "qa_1"])
    assert [d.metric for d in docs] == ["string_match_all"] * 2 + ["string_match_part"] * 2
    assert docs[0].context.endswith("what is it? Answer:")
    with pytest.raises(ValueError, match="cannot be cut"):
        prompt_ids(tiny_tokenizer(), docs[0], max_length=20)
    with pytest.raises(FileNotFoundError, match="vt/validation.jsonl"):
        load_ruler(str(tmp_path), ["vt"])


def test_embedded_qasper_papers_balanced_and_whole():
    docs = load_qasper(limit=6, seed=0)
    assert [d.answers[0] for d in docs] == ["Yes", "No"] * 3
    assert all(d.metric == "yes_no" and len(d.context) > 5_000 for d in docs)
    assert "Abstract" in docs[0].context and docs[0].fields["question"].endswith("?")
    assert len(load_qasper(limit=None)) == 319
    with pytest.raises(ValueError, match="limit must be positive"):
        load_qasper(limit=0)
    with pytest.raises(ValueError, match="balanced subset"):
        load_qasper(limit=300)


def test_long_prompts_lose_their_middle_not_their_ends():
    tok = tiny_tokenizer()
    words = [w for w in dict.fromkeys(WORDS)][3:90]
    doc = Document("t", "0", "{context} team {input}", " ".join(words * 4), ["x"], "qa_f1", 4,
                   chat=False, fields={"input": "film"})          # words of the tiny vocabulary
    ids, cut = prompt_ids(tok, doc, max_length=60)
    assert cut and len(ids) <= 60
    text = tok.decode(ids)
    assert text.startswith(" ".join(words[:10])) and text.endswith("team film")
    full, cut = prompt_ids(tok, doc, max_length=10_000)
    assert not cut and len(full) > 300


def test_documents_are_answered_through_the_method_cache(tmp_path):
    tok = tiny_tokenizer()
    folder = _write_longbench(tmp_path / "lb", tasks=("hotpotqa", "passage_count"), n=2)
    docs = load_longbench(str(folder), ["hotpotqa", "passage_count"])
    model = tiny_llama(0).double()
    method = build_method({"name": "turboquant", "bits": 3})
    method.install(model)
    result = evaluate_documents(model, tok, method, docs, max_length=120)
    assert [s["task"] for s in result["samples"]] == ["hotpotqa"] * 2 + ["passage_count"] * 2
    assert set(result["tasks"]) == {"hotpotqa", "passage_count"}
    assert all(0.0 <= s["score"] <= 1.0 and s["prompt_tokens"] <= 120 for s in result["samples"])
    # the answer is what prefill + token-by-token decoding through the quantised cache gives
    from palu.eval.generation import answer
    ids, _ = prompt_ids(tok, docs[0], 120)
    with torch.no_grad():
        cache = method.make_cache(model)
        logits = model(torch.tensor([ids]), past_key_values=cache, use_cache=True).logits[:, -1]
        steps = []
        for _ in range(docs[0].max_new_tokens):
            nxt = logits.argmax(-1, keepdim=True)
            steps.append(int(nxt))
            logits = model(nxt, past_key_values=cache, use_cache=True).logits[:, -1]
    assert answer(model, tok, method, ids, docs[0].max_new_tokens) == result["samples"][0]["answer"]
    assert tok.decode(steps[:4]) == tok.decode(tok(result["samples"][0]["answer"])["input_ids"][:4])
