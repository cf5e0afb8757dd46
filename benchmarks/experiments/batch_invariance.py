"""Why a quantised cache's answer to a prompt changes with the batch it rides in (issue 49's "share
of answers that differ between batch 1 and batch 64"), measured three ways on the real weights:

  steps      each step's logits of the default slot path on a right-padded batch against each
             prompt alone, and the eager loop's tokens beside them
  layers     row 0's attention and layer outputs, prefilled as [p0] and as [p0, p1] / [p0, p0]:
             the layer where they part and how fast the gap grows
  reference  the last position's logits in float32 and float64 against float64 alone

  python benchmarks/experiments/batch_invariance.py MODE OUT_DIR MODEL TEXT [methods=kivi,atom]
      [lengths=4000,3800,3600,3500] [new=24] [device=cuda] [dtypes=float32,float16] [banded=1,0]

Writes OUT_DIR/batch-invariance-MODE.json and prints one line a row (steps) or a method (layers).
Session 50 on an H100 (results/checks/h100-batch-invariance-session50/): on the CPU every path
equals each prompt alone to 1e-14 in float64 (the float64 tests), and a batch's rows are bit for bit
batch-invariant there; on a GPU the same prompt differs at fp32 rounding between batch shapes even
with dtype=float64 (transformers' RMSNorm and RoPE compute in float32; reduction strategies depend
on the tensor's size), and a quantised cache turns those ~1e-7 differences into code flips: FP16
4.3e-6 apart in the logits, KIVI-8 2.2e-3, KIVI-4 3.2e-2, KIVI-2 0.69, from the same 1e-13 after
layer 0. Token-subset methods and KIVI (whose newest tokens stay exact) keep most answers; Atom and
TurboQuant code every new token at once, so a flip lands on the token the next query attends to most.
"""
from __future__ import annotations

import json
import os
import sys

import torch

import palu
from palu.eval import generation, static_quant
from palu.methods import build_method

CONF = {"fp16": {"name": "fp16"}, "atom": {"name": "atom", "bits": 4},
        "turboquant": {"name": "turboquant", "bits": 3}, "kivi": {"name": "kivi", "bits": 2},
        "kivi-b4": {"name": "kivi", "bits": 4}, "kivi-b8": {"name": "kivi", "bits": 8},
        "kivi_snapkv": {"name": "kivi_snapkv", "bits": 2, "evict_ratio": 0.5}}
MODES = ("steps", "layers", "reference")
SPACING = 5000   # tokens between two prompts' starts in the text


def left_padded(prompts, pad: int = 0):
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


@torch.no_grad()
def greedy_alone(model, method, prompt, n, dev):
    """One prompt alone through the method's own cache, token by token: its tokens and logits."""
    cache = method.make_cache(model)
    logits = [model(torch.tensor([prompt], device=dev), past_key_values=cache).logits[0, -1]]
    tokens = [int(logits[-1].argmax())]
    for _ in range(n - 1):
        logits.append(model(torch.tensor([[tokens[-1]]], device=dev), past_key_values=cache).logits[0, -1])
        tokens.append(int(logits[-1].argmax()))
    return tokens, logits


def _subject(model_path, text, name, dtype, dev, lengths):
    model, tok = palu.load_model(model_path, dtype=dtype, device=dev)
    model.eval()
    model.generation_config.eos_token_id = None
    ids = tok(text[:SPACING * (len(lengths) + 1) * 8]).input_ids
    prompts = [ids[SPACING * i: SPACING * i + n] for i, n in enumerate(lengths)]
    method = build_method(CONF[name])
    method.install(model)
    return model, method, prompts


def steps(model_path, text, name, dtype, dev, lengths, new, **_):
    model, method, prompts = _subject(model_path, text, name, dtype, dev, lengths)
    ids, mask = (t.to(dev) for t in left_padded(prompts))
    trace = []
    with torch.no_grad():
        batch, _ = static_quant.greedy_static_quant(model, method, ids, mask, new, set(), graph=False, trace=trace)
        loop = [n for n, _ in generation._decode_dropping_ended_rows(model, method.make_cache(model), ids, mask,
                                                                      new, set())]
    rows = []
    for r, p in enumerate(prompts):
        tokens, logits = greedy_alone(model, method, p, new, dev)
        diffs = [(trace[k][r].float() - logits[k].float()).abs().max().item() for k in range(new)]
        row = {"method": name, "dtype": dtype, "row": r, "length": len(p), "slots_equal_alone": batch[r] == tokens,
               "first_differing_step": next((k for k, (a, b) in enumerate(zip(batch[r], tokens)) if a != b), None),
               "loop_equal_slots": loop[r] == batch[r], "loop_equal_alone": loop[r] == tokens,
               "max_logit_diff_by_step": diffs}
        print(dtype, name, "row", r, "len", len(p), "slots=alone", row["slots_equal_alone"], "first differing",
              row["first_differing_step"], "loop=slots", row["loop_equal_slots"], "loop=alone",
              row["loop_equal_alone"], "logit diff by step", " ".join("%.0e" % d for d in diffs[:12]), flush=True)
        rows.append(row)
    return rows


def layers(model_path, text, name, dtype, dev, lengths, banded, **_):
    """Row 0 prefilled alone (plain forward and the right-padded path) and beside another prompt
    or itself; every decoder layer's attention and block output compared."""
    model, method, prompts = _subject(model_path, text, name, dtype, dev, lengths[:2])
    p0, p1 = prompts
    rec = {}

    def hook(key):
        def f(mod, args, out):
            o = out[0] if isinstance(out, tuple) else out
            rec.setdefault(key, []).append(o[0].detach().double().cpu())
        return f
    layers_ = model.model.layers
    handles = [lay.self_attn.register_forward_hook(hook(f"attn{i}")) for i, lay in enumerate(layers_)]
    handles += [lay.register_forward_hook(hook(f"layer{i}")) for i, lay in enumerate(layers_)]

    @torch.no_grad()
    def run(rows, plain):
        x = torch.tensor(rows, device=dev)
        cache = method.make_cache(model)
        if plain:
            return model(x, past_key_values=cache, logits_to_keep=1).logits[0, -1].double().cpu()
        T = x.shape[1]
        at = torch.arange(T, device=dev)
        if hasattr(cache, "stash_prompt"):
            cache.stash_prompt([len(p0)] + [len(p1)] * (len(rows) - 1))
        h = model.get_decoder()(input_ids=x, position_ids=at.expand(len(rows), -1), past_key_values=cache,
                                cache_position=at, use_cache=True).last_hidden_state
        return model.get_output_embeddings()(h[0, len(p0) - 1]).double().cpu()

    out = []
    pad = [0] * (len(p0) - len(p1))
    for env in banded:
        os.environ["PALU_BANDED_PREFILL"] = env
        rec.clear()
        la, lb, lc, ld = run([p0], True), run([p0], False), run([p0, p1 + pad], False), run([p0, p0], False)
        res = {"method": name, "dtype": dtype, "banded": env,
               "logits": {"plain_vs_alone": (la - lb).abs().max().item(), "alone_vs_beside_another": (lb - lc).abs().max().item(),
                          "alone_vs_beside_itself": (lb - ld).abs().max().item()}}
        for kind in ("attn", "layer"):
            res[kind] = [[(a - b).abs().max().item(), (b - c).abs().max().item(), (b - d).abs().max().item()]
                         for a, b, c, d in (rec[f"{kind}{i}"] for i in range(len(layers_)))]
        print(name, dtype, dev, "banded", env, "logits:", " ".join("%s %.1e" % kv for kv in res["logits"].items()), flush=True)
        for kind in ("attn", "layer"):
            print("  ", kind, " ".join("%d:%.0e/%.0e/%.0e" % (i, *v) for i, v in enumerate(res[kind])), flush=True)
        out.append(res)
    for h in handles:
        h.remove()
    return out


def reference(model_path, text, name, dtype, dev, lengths, **_):
    """The last position's logits of the first two prompts alone (and, for a quantised cache, in a
    right-padded batch) in `dtype`, against float64 alone."""
    res = {}
    for dt in ("float64", dtype):
        model, method, prompts = _subject(model_path, text, name, dt, dev, lengths[:2])
        with torch.no_grad():
            res[dt, "alone"] = [model(torch.tensor([p], device=dev), past_key_values=method.make_cache(model)
                                      ).logits[0, -1].double().cpu() for p in prompts]
            if static_quant.quant_unsupported(model, method) is None:
                ids, mask = left_padded(prompts)
                trace = []
                static_quant.greedy_static_quant(model, method, ids.to(dev), mask.to(dev), 1, set(), graph=False,
                                                 trace=trace)
                res[dt, "batch"] = [trace[0][r].double().cpu() for r in range(len(prompts))]
    ref = res["float64", "alone"]
    rows = [{"method": name, "dtype": dt, "path": path,
             "max_diff_to_float64_alone": [(a - r).abs().max().item() for a, r in zip(v, ref)]}
            for (dt, path), v in res.items()]
    for row in rows:
        print(name, row["dtype"], row["path"], "max |logit - float64 alone|",
              ["%.1e" % d for d in row["max_diff_to_float64_alone"]], flush=True)
    return rows


def main(mode, out_dir, model_path, text_path, *opts):
    if mode not in MODES:
        raise SystemExit(f"mode {mode!r}: one of {', '.join(MODES)}")
    args = {"methods": "kivi,atom", "lengths": "4000,3800,3600,3500", "new": "24", "device": "cuda",
            "dtypes": "float32,float16", "banded": "1,0"}
    for item in opts:
        key, _, value = item.partition("=")
        if key not in args:
            raise SystemExit(f"unknown option {key!r}: expected one of {sorted(args)}")
        args[key] = value
    names = args["methods"].split(",")
    unknown = [n for n in names if n not in CONF]
    if unknown:
        raise SystemExit(f"methods {unknown}: known are {sorted(CONF)}")
    lengths = [int(x) for x in args["lengths"].split(",")]
    if len(lengths) < 2 or min(lengths) < 2:
        raise SystemExit(f"lengths={args['lengths']!r}: at least two prompts of 2 tokens or more")
    text = open(text_path).read()
    fn = {"steps": steps, "layers": layers, "reference": reference}[mode]
    rows = [row for dt in args["dtypes"].split(",") for name in names
            for row in fn(model_path, text, name, dt, args["device"], lengths, new=int(args["new"]),
                          banded=args["banded"].split(","))]
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"batch-invariance-{mode}.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"mode": mode, "args": args, "model": model_path, "device": args["device"],
                   "gpu": torch.cuda.get_device_name() if args["device"] == "cuda" else None,
                   "torch": torch.__version__, "rows": rows}, f, indent=1)
    os.replace(tmp, path)
    print("->", path)


if __name__ == "__main__":
    main(*sys.argv[1:])
