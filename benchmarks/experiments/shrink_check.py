"""Ended rows leaving a replayed batch (`palu.eval.static_decode.shrink_rows`) on a GPU: for each
method's graph path, a padded batch of real prompts answered under stop tokens that end most rows
early, once as it is (ended rows leave once at most half the batch is live, the step captured
again at the smaller batch) and once with the rows kept to the end (SHRINK_LIVE = 0); answers
compared (fp16 GEMMs of another batch may flip an argmax: the share is reported) and both timed.
Writes OUT/shrink-check.json.

  python benchmarks/experiments/shrink_check.py OUT_DIR MODEL TEXT [methods=fp16,kivi,snapkv,h2o,quest]
      [batch=64] [length=1024] [new=64] [device=cuda] [dtype=float16]

The stop tokens: each row's free answer is decoded first (no stop token); for each of the first
three quarters of the rows, the first token of its answer that no row of the last quarter ever
gives: those rows end early (each at its first stop token), the last quarter never, so the batch
shrinks (at most twice: to half, then to a quarter) and runs its remaining steps smaller. `PALU_STATIC_DECODE=all` serves H2O and Quest.
"""
from __future__ import annotations

import copy
import json
import os
import sys

import torch

import palu
from palu.eval import static_decode
from palu.methods import build_method
from static_latent_check import _batch, _prompts, _timed   # the same prompts and timing (sibling scripts)
from static_subset_check import CONF, greedy_of


def _answerer(model, method):
    """answer(ids, mask, new, stop) -> each row's new tokens, through the method's graph path."""
    if method is None:
        return lambda ids, mask, new, stop: static_decode.greedy_static(model, ids, mask, new, stop)[0]
    greedy = greedy_of(model, method)
    return lambda ids, mask, new, stop: greedy(model, method, ids, mask, new, stop)[0]


def main(out_dir, model_path, text_path, *opts):
    args = {"methods": "fp16,kivi,snapkv,h2o,quest", "batch": "64", "length": "1024", "new": "64",
            "device": "cuda", "dtype": "float16"}
    args.update(o.split("=", 1) for o in opts)
    batch, length, new = (int(args[k]) for k in ("batch", "length", "new"))
    device = args["device"]
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "shrink-check.json")
    result = {"args": args, "device": torch.cuda.get_device_name(0) if device == "cuda" else device,
              "torch": torch.__version__, "methods": {}}
    base, tok = palu.load_model(model_path, dtype=args["dtype"], device=device)
    base.generation_config.eos_token_id = None
    text = tok(open(text_path, encoding="utf-8").read(), add_special_tokens=False)["input_ids"]
    ids, mask = _batch(_prompts(text, batch, length), tok.pad_token_id or 0, device)
    for name in filter(None, args["methods"].split(",")):
        model, method = base, None
        if name != "fp16":
            method = build_method(CONF[name])
            model = copy.deepcopy(base)
            method.install(model)
        answer = _answerer(model, method)
        with torch.no_grad():
            free = answer(ids, mask, new, set())
            keep = len(free) - len(free) // 4
            never = {t for n in free[keep:] for t in n}
            stop = {next((t for t in n if t not in never), None) for n in free[:keep]} - {None}
            ends = [next((k for k, t in enumerate(n) if t in stop), new - 1) for n in free]
            expected = [n[:e + 1] for n, e in zip(free, ends)]
            runs = {}
            for label, live in (("shrinking", static_decode.SHRINK_LIVE), ("kept", 0.0)):
                static_decode.SHRINK_LIVE = live
                try:
                    seconds, got = _timed(lambda: answer(ids, mask, new, stop), device)
                finally:
                    static_decode.SHRINK_LIVE = 0.5
                runs[label] = {"seconds": seconds, "rows_equal_free_answer_cut": sum(a == b for a, b in zip(got, expected)),
                               "tokens": sum(map(len, got))}
        result["methods"][name] = {"rows": len(free), "stop_tokens": len(stop),
                                   "end_steps": ends, **runs,
                                   "speedup": runs["kept"]["seconds"] / runs["shrinking"]["seconds"]}
        print(name, json.dumps(result["methods"][name]), flush=True)
        del model
        with open(path + ".tmp", "w") as fh:
            json.dump(result, fh, indent=1)
        os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main(*sys.argv[1:])
