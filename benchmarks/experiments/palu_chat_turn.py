"""Why Palu-50 % scores near zero on the long-context suites of an instruct model while its
zero-shot accuracy drops only 3 points: it ends the assistant's turn at once. For each variant (the
model compressed in place, every Palu setting calibrated on the same 24 x 2048-token windows), on
RULER-style niah_single prompts at 1K and 4K tokens in the model's chat template: the probability
of the end-of-turn token as the first answer token, the share of empty answers (16 greedy tokens),
and the share answered right. The last variant calibrates J-LRD on the same Wikipedia paragraphs
laid out as chat turns, to test whether the calibration never seeing a turn is the cause.

    python benchmarks/experiments/palu_chat_turn.py results/checks/palu-chat-turn.json

Zero-shot tasks score log-likelihoods of given continuations, so they never ask the model to end
a turn; a generation suite does. ~10 min on 2 CPU cores.
"""
from __future__ import annotations

import copy
import statistics
import sys
import time

import torch

import palu
from palu.artifacts import write_json
from palu.calib.gram import collect_grams
from palu.eval.documents import prompt_ids
from palu.eval.generation import answer
from palu.eval.ruler_style import RulerStyleSettings, make_documents, squad_questions

MODEL = "work/models/smollm2-135m"
LENGTHS, PER_LENGTH, NEW_TOKENS = (1024, 4096), 8, 16
VARIANTS = (("fp16", None, None, "wiki"), ("palu-30% J-LRD", 0.7, 3, "wiki"),
            ("palu-50% J-LRD", 0.5, 3, "wiki"), ("palu-50% M-LRD", 0.5, 1, "wiki"),
            ("palu-50% J-LRD, calibrated in chat turns", 0.5, 3, "chat"))


def chat_turns(tok, text: str) -> str:
    """The calibration paragraphs two by two as a user turn and an assistant turn."""
    paras = [p for p in text.split("\n") if len(p) > 200]
    return "\n".join(tok.apply_chat_template([{"role": "user", "content": a}, {"role": "assistant", "content": b}],
                                             tokenize=False) for a, b in zip(paras[::2], paras[1::2]))


def main(out: str) -> None:
    torch.set_num_threads(2)
    base, tok = palu.load_model(MODEL, dtype="float32")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    if end is None or end == tok.unk_token_id:
        raise SystemExit(f"{MODEL}: no <|im_end|> token; this check is for ChatML instruct models")
    wiki = palu.load_corpus("wiki_standin").calibration_text
    texts = {"wiki": wiki, "chat": chat_turns(tok, wiki)}
    grams = {}
    haystack = palu.load_corpus("novels_standin").evaluation_text
    docs = {L: make_documents(tok, RulerStyleSettings(tasks=["niah_single"], lengths=[L], per_task=PER_LENGTH),
                              haystack, squad_questions()) for L in LENGTHS}
    rows = []
    for label, kept, group, calib in VARIANTS:
        t0 = time.time()
        model = copy.deepcopy(base)
        if kept is not None:
            if calib not in grams:
                windows = palu.calibration_data(tok, text=texts[calib], samples=24, seqlen=2048, seed=0)
                grams[calib] = collect_grams(base, windows, progress=False)["gram"]
            palu.compress(model, None, kept_ratio=kept, group_size=group, grams=grams[calib], progress=False)
        for L, ds in docs.items():
            p_end, empty, right = [], 0, 0
            for d in ds:
                ids, _ = prompt_ids(tok, d, L)
                with torch.no_grad():
                    p_end.append(float(model(torch.tensor([ids])).logits[0, -1].softmax(-1)[end]))
                text = answer(model, tok, None, ids, NEW_TOKENS)
                empty += not text.strip()
                right += all(a in text for a in d.answers)
            rows.append({"variant": label, "kept_ratio": kept, "group_size": group, "calibration": calib,
                         "length": L, "n": len(ds), "p_end_first_mean": round(statistics.mean(p_end), 4),
                         "p_end_first": [round(p, 4) for p in p_end], "empty": empty, "right": right})
            print(f"{label:45s} {L:5d}: P(<|im_end|> first) {statistics.mean(p_end):.3f}, "
                  f"empty {empty}/{len(ds)}, right {right}/{len(ds)} ({time.time() - t0:.0f} s)", flush=True)
    write_json(out, {"model": MODEL, "task": "niah_single (RULER-style, novels haystack)",
                     "new_tokens": NEW_TOKENS, "calibration": {"samples": 24, "seqlen": 2048, "seed": 0}, "rows": rows})


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "results/checks/palu-chat-turn.json")
