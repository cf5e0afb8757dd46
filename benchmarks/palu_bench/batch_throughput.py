"""Prompts per second of the long-context suites' answering path (`palu.eval.generation.
answer_batches`) by method and batch size, beside transformers' own `generate` (its dynamic cache,
and its static cache with a compiled decode step) in the same run; and, at a fixed KV-cache
memory budget, the largest batch each method's cache fits and its throughput (issue 49).

  python -m palu_bench.batch_throughput OUT_DIR model=PATH.gguf text=PATH.txt
      ['methods=[fp16,palu50-b16,palu50-b4,atom-b4,turboquant-b3]' 'batches=[1,16,64,128]'
       'length=4032' 'new_tokens=64' 'budget_gib=4' 'time_limit=480' 'device=cuda' 'dtype=float16']

Prompts are windows of `text` (a few hundred tokens apart) of different lengths (the longest
`length` tokens, the shortest 7/8 of it), so every batch is left-padded. Every path generates
`new_tokens` greedily with EOS switched off; `fp16` decodes through a CUDA graph on a GPU
(`palu.eval.static_decode`), `fp16-eager` through the eager loop it replaced (the same work for every row and path). Batch 1 is
timed over `ones` prompts one at a time; each other size over one batch of that many prompts.
The share of answers that differ between batch 1 and the batch of `agree_batch` (the same
prompts) is reported per method: fp16 reductions can flip an argmax. The JSON is rewritten after
every measurement, so a run stopped at its time limit keeps what it measured.

`model=random:smollm2-135m` (or `random:FOLDER` with a config.json), no `text=`: the model's shapes
with random weights and random prompts (`random_subject`), for a GPU host where the real weights
and the wheelhouse are not staged; the JSON says `"weights": "random"` and so does the table.
"""
from __future__ import annotations

import copy
import datetime
import json
import os
import platform
import sys
import tempfile
import time

import torch

METHODS = {
    "fp16": {"name": "fp16"},
    "fp16-eager": {"name": "fp16", "decode": "0"},   # the eager decode loop (PALU_STATIC_DECODE=0)
    "palu50-b16": {"name": "palu", "latent_bits": 16, "decode": "fp16"},   # the eager LatentCache loop
    "palu50-b4": {"name": "palu", "latent_bits": 4, "decode": "fp16"},
    # plain Palu through GraphLatentCache and replayed steps (the default since session 35)
    "palu50-b16-graph": {"name": "palu", "latent_bits": 16},
    "palu50-b4-graph": {"name": "palu", "latent_bits": 4},
    "atom-b4": {"name": "atom", "bits": 4},
    "turboquant-b3": {"name": "turboquant", "bits": 3},
    "kivi-b2": {"name": "kivi", "bits": 2},
    "snapkv": {"name": "snapkv", "compression_ratio": 0.5, "decode": "palu"},   # the eager loop
    "pyramidkv": {"name": "pyramidkv", "compression_ratio": 0.5, "decode": "palu"},
    # the eager loop (PALU_STATIC_DECODE=palu), as these names timed until session 49
    "streaming_llm": {"name": "streaming_llm", "sink": 4, "window": 2048, "decode": "palu"},
    "h2o": {"name": "h2o", "budget": 2048, "window": 64, "decode": "palu"},
    "tova": {"name": "tova", "budget": 2048, "decode": "palu"},
    "quest": {"name": "quest", "page": 16, "budget": 1024, "decode": "palu"},
    "kivi-b4": {"name": "kivi", "bits": 4},
    "kivi_snapkv": {"name": "kivi_snapkv", "bits": 2, "evict_ratio": 0.5},
    # SnapKV / PyramidKV decoding in preallocated slots, replayed (the default since session 36)
    "snapkv-graph": {"name": "snapkv", "compression_ratio": 0.5},
    "pyramidkv-graph": {"name": "pyramidkv", "compression_ratio": 0.5},
    # StreamingLLM / TOVA / H2O in evicting slots, Quest selecting in slots, replayed (the default
    # since session 49, so the names without -graph take them too; `all` adds graphs recaptured
    # as rows end, which EOS off never triggers here)
    "streaming_llm-graph": {"name": "streaming_llm", "sink": 4, "window": 2048, "decode": "all"},
    "tova-graph": {"name": "tova", "budget": 2048, "decode": "all"},
    "quest-graph": {"name": "quest", "page": 16, "budget": 1024, "decode": "all"},
    "h2o-graph": {"name": "h2o", "budget": 2048, "window": 64, "decode": "all"},
    # the quantised caches in preallocated slots, blocks coded on the device, replayed
    # (cache/quant_slots.py; the default since session 38, so `kivi-b2` above takes them too);
    # a padded batch prefills right-padded (KIVI's default since session 46, KIVI + SnapKV's, Atom's
    # and TurboQuant's since session 49, so `-graph` now times the default path for each)
    "kivi-b2-graph": {"name": "kivi", "bits": 2, "decode": "all"},
    "kivi-b4-graph": {"name": "kivi", "bits": 4, "decode": "all"},
    # their one-pass prefill through the masked view (PALU_BANDED_PREFILL=0; banded since session 45)
    "kivi-b2-graph-masked": {"name": "kivi", "bits": 2, "decode": "all", "prefill": "0"},
    "kivi-b4-graph-masked": {"name": "kivi", "bits": 4, "decode": "all", "prefill": "0"},
    "kivi_snapkv-graph": {"name": "kivi_snapkv", "bits": 2, "evict_ratio": 0.5, "decode": "all"},
    "atom-b4-graph": {"name": "atom", "bits": 4, "decode": "all"},
    "turboquant-b3-graph": {"name": "turboquant", "bits": 3, "decode": "all"},
    # the model's norms, MLPs and RoPE in torch's own kernels (PALU_FUSED_OPS=0; fused on a GPU
    # since session 51, `palu.models.fused_layers`): the default paths as they were before
    "fp16-unfused": {"name": "fp16", "fused": "0"},
    "palu50-b4-graph-unfused": {"name": "palu", "latent_bits": 4, "fused": "0"},
    "kivi-b2-unfused": {"name": "kivi", "bits": 2, "fused": "0"},
    "snapkv-graph-unfused": {"name": "snapkv", "compression_ratio": 0.5, "fused": "0"},
}
SWITCHES = {"decode": ("PALU_STATIC_DECODE", "1"), "prefill": ("PALU_BANDED_PREFILL", "1"),
            "fused": ("PALU_FUSED_OPS", "1")}


def set_switches(name: str) -> None:
    """The decode switches method `name` is timed under (each unnamed one at its default)."""
    for key, (env, default) in SWITCHES.items():
        os.environ[env] = METHODS[name].get(key, default)
DEFAULTS = {"methods": ["fp16", "palu50-b16", "palu50-b4", "atom-b4", "turboquant-b3"],
            "batches": [1, 16, 64, 128], "length": 4032, "new_tokens": 64, "ones": 4,
            "agree_batch": 64, "budget_gib": 4.0, "budget_methods": ["fp16", "palu50-b4"],
            "references": ["dynamic", "static"], "time_limit": 480.0, "device": "cuda",
            "dtype": "float16", "model": None, "text": None, "calib_windows": 16,
            "method_batches": {}, "reference_batches": None}   # default: 1 and the largest batch   # method -> its own batch sizes (default: `batches`)


class Run:
    """The results so far, written to OUT_DIR/batch-throughput.json after every measurement."""

    def __init__(self, out_dir: str, args: dict):
        self.path = os.path.join(out_dir, "batch-throughput.json")
        self.start = time.perf_counter()
        self.limit = args["time_limit"]
        self.data = {"config": {**args, "warmup": "full"}, "env": _env(args["device"]), "rows": [],
                     "skipped": []}

    def left(self) -> float:
        return self.limit - (time.perf_counter() - self.start)

    def add(self, row: dict) -> None:
        self.data["rows"].append(row)
        print(json.dumps(row), flush=True)
        self.save()

    def skip(self, what: str, why: str = "time limit") -> None:
        self.data["skipped"].append(what if why == "time limit" else f"{what} ({why})")
        print(f"skipped ({why}): {what}", flush=True)
        self.save()

    def save(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(self.data, fh, indent=1)
        os.replace(tmp, self.path)


def _env(device: str) -> dict:
    import transformers
    env = {"torch": torch.__version__, "transformers": transformers.__version__,
           "python": platform.python_version(),
           # when: run names carry a session at best, and a fresh clone's files all share one mtime
           "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def load_subject(args: dict, count: int):
    """(model, tokenizer, token ids) to time: the model and text given, or with `model=random:...`
    a model of those shapes with random weights and random ids (`random_subject`)."""
    from .random_subject import is_random, random_subject
    if is_random(args["model"]):
        tokens = args["calib_windows"] * 1024 + args["length"] + 397 * max(count, 512) + 1
        return random_subject(args["model"], tokens, args["dtype"], args["device"])
    import palu
    model, tok = palu.load_model(args["model"], dtype=args["dtype"], device=args["device"])
    model.generation_config.eos_token_id = None       # every row generates new_tokens
    with open(args["text"], encoding="utf-8") as fh:
        ids = tok(fh.read(), add_special_tokens=False)["input_ids"]
    return model, tok, ids


def make_prompts(token_ids: list[int], count: int, length: int, stride: int = 397) -> list[list[int]]:
    """`count` windows of the text, lengths spread over [7/8 length, length], longest first."""
    span = len(token_ids) - length
    if span <= 0:
        raise ValueError(f"the text has {len(token_ids)} tokens, fewer than a prompt of {length}")
    shortest = length - length // 8
    out = []
    for i in range(count):
        n = length - (i * 7919) % (length - shortest + 1)
        start = (i * stride) % span
        out.append(token_ids[start:start + n])
    return sorted(out, key=len, reverse=True)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _peak_reset(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None


def time_ours(model, tok, method, prompts, new_tokens, batch, device):
    """(seconds, answers) of `prompts` answered `batch` at a time through the method's cache,
    after an untimed warm-up batch of the same shape and answer length (the first call of a new
    batch shape spent ~8 s on the H200 in kernel selection and allocator growth). Until session
    45 the warm-up answered 2 tokens, so whatever an answer first meets later (a Triton
    specialisation of a growing cache length, a slot bucket's graph) was compiled or captured
    inside the timing: the likely reason, not measured, why Palu-50 % 4-bit took 13.6 prompts/s
    at batch 64, then 46.7 at batch 323 in the same process
    (`results/throughput/h100-smollm2-4k-session45.json`)."""
    from palu.eval.generation import answer_batches
    answer_batches(model, tok, method, prompts[:batch], new_tokens, batch_size=batch)
    _sync(device)
    t = time.perf_counter()
    answers = answer_batches(model, tok, method, prompts, new_tokens, batch_size=batch)
    _sync(device)
    return time.perf_counter() - t, answers


def time_reference(model, tok, prompts, new_tokens, kind, device):
    """Seconds of transformers' `generate` over `prompts` as one left-padded batch, with its
    dynamic cache or its static cache (compiled decode step), after an untimed warm-up call of the
    same shape (compilation, kernel selection)."""
    width = max(map(len, prompts))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id   # as answer_batches pads
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    kwargs = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=pad)
    if kind == "static":
        kwargs["cache_implementation"] = "static"
    with torch.no_grad():
        model.generate(ids, **kwargs if kind == "static" else {**kwargs, "max_new_tokens": 2})   # warm-up
        _sync(device)
        t = time.perf_counter()
        model.generate(ids, **kwargs)
        _sync(device)
    return time.perf_counter() - t


def _checkpoint(model, windows, folder: str) -> str:
    import palu
    geom = palu.geometry_of(model.config)
    result = palu.compress(copy.deepcopy(model), windows, kept_ratio=0.5, group_size=geom.num_kv_heads,
                           progress=False)
    path = os.path.join(folder, "palu50-j")
    result.save(path)
    return path


def checkpoint_if_needed(model, windows, folder: str, names) -> str | None:
    """A Palu checkpoint where one of the methods `names` is Palu's (compressing costs minutes)."""
    return _checkpoint(model, windows, folder) if any(METHODS[n]["name"] == "palu" for n in names) else None


def _method(model, name, ckpt):
    from palu.methods import build_method
    conf = {k: v for k, v in METHODS[name].items() if k not in SWITCHES}
    if conf["name"].startswith("palu"):
        conf["checkpoint"] = ckpt
    method = build_method(conf)
    m = copy.deepcopy(model)
    method.install(m)
    return method, m


def measure_method(run, model, tok, name, ckpt, prompts, args):
    from palu.eval.generation import decode_switches
    device, new = args["device"], args["new_tokens"]
    method, m = _method(model, name, ckpt)
    set_switches(name)
    ones = None
    for batch in args["method_batches"].get(name, args["batches"]):
        if run.left() < 30:
            run.skip(f"{name} batch {batch}")
            continue
        chosen = prompts[:args["ones"]] if batch == 1 else prompts[:batch]
        _peak_reset(device)
        try:
            seconds, answers = time_ours(m, tok, method, chosen, new, batch, device)
        except torch.OutOfMemoryError:
            run.add({"path": "palu", "method": name, "batch": batch, "oom": True})
            continue
        row = {"path": "palu", "method": name, "batch": batch, "prompts": len(chosen),
               "seconds": seconds, "prompts_per_s": len(chosen) / seconds, "peak_gib": _peak(device),
               "batched": batch == 1 or method.padded_batches, "switches": decode_switches(),
               "kv_bytes_per_prompt": max(b["stored"] for _, b in answers)}
        if batch == 1:
            ones = [a for a, _ in answers]
        elif batch == args["agree_batch"] and ones is not None:
            differ = sum(a != b for a, (b, _) in zip(ones, answers))
            row["agreement"] = {"prompts": len(ones), "differ": differ}
        run.add(row)
    return method, m


def measure_budget(run, model, tok, name, ckpt, prompts, args, per_prompt: int):
    """The largest batch whose KV cache fits `budget_gib` (bytes as stored, measured), timed."""
    device = args["device"]
    batch = int(args["budget_gib"] * 2**30 // per_prompt)
    if batch < 1 or run.left() < 60:
        run.skip(f"budget {name}")
        return
    method, m = _method(model, name, ckpt)
    set_switches(name)
    chosen = prompts[:min(batch, len(prompts))]
    _peak_reset(device)
    try:
        seconds, answers = time_ours(m, tok, method, chosen, args["new_tokens"], len(chosen), device)
    except torch.OutOfMemoryError:
        run.add({"path": "budget", "method": name, "batch": len(chosen), "oom": True})
        return
    run.add({"path": "budget", "method": name, "budget_gib": args["budget_gib"], "fits": batch,
             "batch": len(chosen), "prompts_per_s": len(chosen) / seconds, "seconds": seconds,
             "peak_gib": _peak(device), "kv_gib": sum(b["stored"] for _, b in answers) / 2**30})


def overrides(items: list[str], defaults: dict = DEFAULTS) -> dict:
    """`defaults` with `key=value` items (values read as YAML); an unknown key, a missing model= /
    text= and a method not in METHODS are errors."""
    import yaml
    args = dict(defaults)
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in defaults:
            raise SystemExit(f"{item!r}: expected key=value with a key among {sorted(defaults)}")
        args[key] = yaml.safe_load(value)
    from .random_subject import is_random
    for key in ("model", "text"):
        if not args[key] and not (key == "text" and is_random(args["model"])):
            raise SystemExit(f"{key}= is required" + (" (or model=random:NAME)" if key == "text" else ""))
    unknown = sorted(set(args["methods"]) - set(METHODS))
    if unknown:
        raise SystemExit(f"methods {unknown} are not among {sorted(METHODS)}")
    # a budget row sizes its batch by the bytes a prompt took in the method's own rows
    unmeasured = [m for m in args.get("budget_methods", []) if m not in args["methods"]]
    if unmeasured:
        raise SystemExit(f"budget_methods {unmeasured} are not among methods={args['methods']}: a budget "
                         "row's batch comes from the bytes per prompt its method's rows measured")
    return args


def main(argv: list[str]) -> None:
    from .random_subject import is_random
    if not argv:
        raise SystemExit(__doc__)
    out_dir, args = argv[0], overrides(argv[1:])
    os.makedirs(out_dir, exist_ok=True)
    run = Run(out_dir, args)
    run.data["weights"] = "random" if is_random(args["model"]) else "real"
    device = args["device"]
    count = max(max(args["batches"]), *[max(b) for b in args["method_batches"].values()], args["ones"],
                args["agree_batch"])
    model, tok, ids = load_subject(args, count)
    fits_fp16 = None
    with tempfile.TemporaryDirectory() as tmp:
        windows = torch.tensor([ids[i * 1024:(i + 1) * 1024] for i in range(args["calib_windows"])], device=device)
        ckpt = checkpoint_if_needed(model, windows, tmp, args["methods"] + args["budget_methods"])
        prompts = make_prompts(ids[args["calib_windows"] * 1024:], max(count, 512), args["length"])
        per_prompt = {}
        for name in args["methods"]:
            measure_method(run, model, tok, name, ckpt, prompts, args)
            rows = [r for r in run.data["rows"] if r.get("method") == name and "kv_bytes_per_prompt" in r]
            if rows:
                per_prompt[name] = max(r["kv_bytes_per_prompt"] for r in rows)
        for kind in args["references"]:
            for batch in args["reference_batches"] or (1, max(args["batches"])):
                if run.left() < 60:
                    run.skip(f"transformers {kind} batch {batch}")
                    continue
                _peak_reset(device)
                seconds = time_reference(model, tok, prompts[:batch], args["new_tokens"], kind, device)
                run.add({"path": f"transformers-{kind}", "method": "fp16", "batch": batch, "prompts": batch,
                         "seconds": seconds, "prompts_per_s": batch / seconds, "peak_gib": _peak(device)})
        for name in args["budget_methods"]:
            if name in per_prompt:
                measure_budget(run, model, tok, name, ckpt, prompts, args, per_prompt[name])
            else:
                run.skip(f"budget {name}", "its rows measured no bytes per prompt")
    print(f"-> {run.path}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
