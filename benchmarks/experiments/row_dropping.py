"""What a row leaving the batch at its stop token saves (issue 49; `palu.eval.generation`), on the
embedded SmolLM2-135M-Instruct (float32, CPU, 2 threads) and RULER-style prompts: the same batches
answered by transformers' `generate` (finished rows decode pads until the batch ends) and by the
row-dropping loop, with their answers compared, their wall times, and the rows a decode step
carries (summed over steps: the work the decode does, in rows x steps).

Measured 2026-12-04 (results/checks/row-dropping.json): see the file; the README quotes it.

    python benchmarks/experiments/row_dropping.py results/checks/row-dropping.json
"""
from __future__ import annotations

import sys
import time

import torch

from palu.artifacts import write_json
from palu.data.corpora import load_corpus
from palu.eval import generation
from palu.eval.documents import prompt_ids
from palu.eval.ruler_style import RulerStyleSettings, make_documents, squad_questions
from palu.methods.base import build_method
from palu.models.loading import load_model

MODEL = "work/models/smollm2-135m"
PALU = "work/palu/smollm2-135m/wiki_standin-n24-L2048-s0-float32/no-fisher/palu-whitened-uniform-k0.5-g3-m8"
METHODS = {"fp16": None, "palu-50% 4-bit": {"name": "palu", "checkpoint": PALU, "latent_bits": 4},
           "snapkv": {"name": "snapkv", "compression_ratio": 0.5}}
LENGTH, PER_TASK, BATCH = 1024, 4, 8
TASKS = ["niah_single", "niah_multikey", "niah_multivalue", "vt", "qa"]


def main(out: str) -> None:
    torch.set_num_threads(2)
    rows = []
    for name, cfg in METHODS.items():
        model, tok = load_model(MODEL, dtype="float32")
        method = build_method(cfg) if cfg else None
        if method is not None:
            method.install(model)
        s = RulerStyleSettings(tasks=TASKS, lengths=[LENGTH], per_task=PER_TASK)
        docs = make_documents(tok, s, load_corpus(s.corpus).evaluation_text, squad_questions())
        prompts = [prompt_ids(tok, d, LENGTH)[0] for d in docs]
        news = [d.max_new_tokens for d in docs]
        carried = []
        hook = model.model.layers[0].register_forward_pre_hook(
            lambda mod, args, kw: carried.append((args[0] if args else kw["hidden_states"]).shape[:2]),
            with_kwargs=True)
        result = {}
        for way, plain in (("generate", False), ("row-dropping loop", True)):
            carried.clear()
            generation.plain_greedy = (lambda plain: lambda model: plain)(plain)
            start = time.perf_counter()
            answers = generation.answer_batches(model, tok, method, prompts, news, batch_size=BATCH)
            seconds = time.perf_counter() - start
            decode_rows = sum(b for b, t in carried if t == 1)
            result[way] = {"seconds": round(seconds, 2), "decode_row_steps": decode_rows, "answers": answers}
            print(f"{name:16s} {way:18s} {seconds:7.1f} s  decode rows x steps {decode_rows}", flush=True)
        hook.remove()
        same = sum(a == b for a, b in zip(result["generate"]["answers"], result["row-dropping loop"]["answers"]))
        new_tokens = sum(len(tok(a[0], add_special_tokens=False)["input_ids"]) for a in result["generate"]["answers"])
        rows.append({"method": name, "prompts": len(prompts), "answers_equal": same,
                     **{f"{way}_seconds": r["seconds"] for way, r in result.items()},
                     **{f"{way}_decode_row_steps": r["decode_row_steps"] for way, r in result.items()},
                     "answer_tokens_approx": new_tokens})
    write_json(out, {"model": MODEL, "dtype": "float32", "device": "cpu, 2 threads", "batch": BATCH,
                     "prompt_length": LENGTH, "tasks": TASKS, "per_task": PER_TASK, "rows": rows})


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "results/checks/row-dropping.json")
