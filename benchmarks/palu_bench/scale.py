"""Paper scale on one GPU: the library's pipeline steps at Llama-2-7B / Llama-3-8B shapes.

A `LlamaForCausalLM` of the shape with random weights (transformers' own initialisation, in the
configured dtype) runs every step the paper grid (`conf/grid/paper.yaml`) runs, through the same
library functions its entry points call, on windows of random token ids:

    load          the model saved with a tokenizer, then `palu.load_model` (what every job does)
    gram          `collect_grams` over `gram_windows` windows of `seqlen` tokens
    fisher        `collect_fisher` over `fisher_windows` windows (one backward pass each)
    ranks         uniform / fisher (`allocate`), the whitened SVDs, probe_select (`allocate_probed`)
    decompose     `decompose_model` at each group size (M-LRD, G-LRD, J-LRD), checkpoint saved
    kvquant       `capture_activations` + `fit_from_activations` (the kvquant_capture / fit steps)
    ppl           `perplexity` of `eval_windows` windows through every cache method
    ppl_batched   the same over `eval_batch.windows` windows, `eval_batch.batch` a forward (as
                  the evaluate step runs them with `data.batch_size`: equal lengths, no padding)
    zeroshot      lm-eval's log-likelihood requests as `eval.zeroshot.method_lm` runs them: one
                  prefill of `zeroshot.length` tokens into a fresh cache per request
    zeroshot_batched  the same, `zeroshot.batch` requests per forward (as `zeroshot.batch_size`
                  runs them: one fresh cache per batch; requests of one length, so no padding)
    longcontext   a `longcontext.context`-token prompt prefilled into each method's cache and
                  `longcontext.new_tokens` generated through it (`model.generate`, greedy)
    longcontext_batched  `longcontext.batch` prompts of `longcontext.batch_context` tokens answered
                  together by `answer_batches` (the long-context suites' path: replayed CUDA
                  graphs where a method has them), `new_tokens` each, EOS off

`steps=[...]` runs only the named measurements (of STEPS) and what they need (the Gram, the Palu
checkpoint the methods read, KVQuant's fit): a later partial run adds rows, and the scale table
takes each (shape, step, variant) from the newest run that measured it.

Per step: wall seconds (device synchronised), tokens and tokens/s, the GPU memory allocated at
its peak and before it (the job's own need is the model's weights plus the difference), the
host's resident high-water mark. A step that fails is an error row (its message), never a
number; later steps that need its output are skipped with the reason. The quality numbers of
random weights (a perplexity near the vocabulary size) only prove the path ran end to end.

    python -m palu_bench.scale OUT shape=llama2-7b        (or the Hydra entry palu_bench.cli.scale)
"""
from __future__ import annotations

import copy
import gc
import json
import platform
import resource
import shutil
import tempfile
import time
from pathlib import Path

import torch

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# what `steps` may name; `gram`, the checkpoint the Palu methods read and KVQuant's fit run
# whenever a method's evaluation needs them
STEPS = ("fisher", "ranks", "decompose", "kvquant", "ppl", "ppl_batched", "zeroshot", "zeroshot_batched",
         "longcontext", "longcontext_batched")
EVAL_STEPS = ("ppl", "ppl_batched", "zeroshot", "zeroshot_batched", "longcontext", "longcontext_batched")


class Steps:
    """Runs named steps, each timed and measured; a failure is recorded and returns None. Each
    row is also appended to `partial` (JSON lines) as it is made, so a run stopped at a time
    limit still leaves what it measured."""

    def __init__(self, shape: str, device: str, log, partial: Path | None = None):
        self.shape, self.device, self.log, self.rows, self.partial = shape, device, log, [], partial

    def _add(self, row: dict) -> None:
        self.rows.append(row)
        if self.partial is not None:
            import json
            with open(self.partial, "a") as f:
                f.write(json.dumps(row, default=str) + "\n")

    def _sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()

    def run(self, step: str, fn, variant: str = "", tokens: int | None = None, needs=()):
        row = {"shape": self.shape, "step": step, "variant": variant}
        missing = [name for name, value in needs if value is None]
        if missing:
            row["error"] = f"skipped: needs {', '.join(missing)}, which failed"
            self._add(row)
            self.log(f"[{self.shape}] {step} {variant}: {row['error']}")
            return None
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            row["resident_before_bytes"] = torch.cuda.memory_allocated()
        self._sync()
        start = time.perf_counter()
        try:
            out = fn()
            self._sync()
        except Exception as err:   # an error row, and the run goes on
            row["seconds"] = time.perf_counter() - start
            row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
            self._add(row)
            self.log(f"[{self.shape}] {step} {variant}: FAILED {row['error']}")
            if self.device == "cuda":
                torch.cuda.empty_cache()
            return None
        row["seconds"] = time.perf_counter() - start
        if tokens:
            row["tokens"] = tokens
            row["tokens_per_s"] = tokens / row["seconds"]
        if self.device == "cuda":
            row["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
        row["host_rss_max_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        extra = out[1] if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict) else {}
        row.update(extra)
        self._add(row)
        peak = f", peak {row['peak_gpu_bytes'] / 2**30:.1f} GiB" if "peak_gpu_bytes" in row else ""
        rate = f", {row['tokens_per_s']:.0f} tok/s" if tokens else ""
        self.log(f"[{self.shape}] {step} {variant}: {row['seconds']:.2f} s{rate}{peak}")
        return out[0] if extra else out


def _config(shape: dict):
    from transformers import LlamaConfig
    return LlamaConfig(**shape, head_dim=shape["hidden_size"] // shape["num_attention_heads"],
                       tie_word_embeddings=False)


def _random_model(shape: dict, dtype, device: str, seed: int):
    from transformers import LlamaForCausalLM
    torch.manual_seed(seed)
    with torch.device(device):      # initialised where it runs: no 7B copy through the host
        model = LlamaForCausalLM._from_config(_config(shape), dtype=dtype)
    return model.eval()


def _tokenizer(vocab: int):
    """A word-level tokenizer of the model's vocabulary size (load_model reads one beside the
    weights; the steps here feed token ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1", bos_token="t2")


def _windows(n: int, seqlen: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def _method(conf: dict, checkpoint: str | None, state: str | None):
    from palu.methods import build_method
    conf = dict(conf)
    if conf["name"] == "palu":
        conf["checkpoint"] = checkpoint
    if conf["name"] == "kvquant":
        conf = {"name": "kvquant", "state": state}
    return build_method(conf)


def _label(conf: dict) -> str:
    """palu-b4, kivi-b2, ...: a quantiser's `bits` or Palu's `latent_bits`."""
    width = conf.get("bits", conf.get("latent_bits"))
    return conf["name"] + ("" if width is None else f"-b{width}")


def run_shape(name: str, cfg: dict, scratch: Path, log, partial: Path | None = None) -> tuple[list[dict], dict]:
    """Every step at one shape; its rows and what the shape is."""
    from palu.calib.fisher import collect_fisher
    from palu.calib.gram import collect_grams
    from palu.compress import build_manifest
    from palu.decompose.checkpoint import save_compressed, source_hash
    from palu.decompose.factors import decompose_model
    from palu.decompose.probe import allocate_probed
    from palu.decompose.ranks import allocate
    from palu.decompose.spectra import whitened_svds
    from palu.eval.perplexity import perplexity
    from palu.calib.kvquant import capture_activations, fit_from_activations
    from palu.models.adapters import geometry_of
    from palu.models.loading import load_model

    shape, device, dtype = cfg["shapes"][name], cfg["device"], _DTYPES[cfg["dtype"]]
    S = Steps(name, device, log, partial)
    chosen = cfg.get("steps")
    want = lambda step: chosen is None or step in chosen   # noqa: E731
    L, vocab = cfg["seqlen"], shape["vocab_size"]
    model = S.run("build", lambda: _random_model(shape, dtype, device, cfg["seed"]))
    if model is None:
        return S.rows, {}
    geom = geometry_of(model.config)
    info = {"config": model.config.to_dict(), "weight_bytes": sum(p.numel() * p.element_size()
                                                                  for p in model.parameters()),
            "num_kv_heads": geom.num_kv_heads}
    tok = _tokenizer(vocab)
    if cfg.get("load", True):
        folder = scratch / name

        def save():
            model.save_pretrained(folder)
            tok.save_pretrained(folder)
        S.run("save", save)
        del model
        gc.collect()
        loaded = S.run("load", lambda: load_model(str(folder), dtype=cfg["dtype"], device=device))
        model = loaded[0] if loaded else _random_model(shape, dtype, device, cfg["seed"])
        shutil.rmtree(folder, ignore_errors=True)

    gram_w = _windows(cfg["gram_windows"], L, vocab, 0)
    grams = S.run("gram", lambda: collect_grams(model, gram_w, progress=False)["gram"],
                  tokens=gram_w.numel())
    kept, mult = cfg["kept_ratio"], cfg["rank_multiple"]
    stats = None
    if want("fisher") or want("ranks"):
        fisher_w = _windows(cfg["fisher_windows"], L, vocab, 1)
        stats = S.run("fisher", lambda: collect_fisher(model, fisher_w, progress=False), tokens=fisher_w.numel())
    sizes = [geom.num_kv_heads if g == "kv_heads" else int(g) for g in cfg["group_sizes"]]
    if want("ranks"):
        for g in sizes:
            S.run("ranks", lambda: allocate(geom, kept, g, "uniform", mult), variant=f"uniform-g{g}")
        if stats is not None:
            S.run("ranks", lambda: allocate(geom, kept, 1, "fisher", mult, stats["fisher"]), variant="fisher-g1")
        pg = geom.num_kv_heads if cfg["probe_group_size"] == "kv_heads" else int(cfg["probe_group_size"])
        svds = S.run("whitened_svds", lambda: whitened_svds(model, grams, pg), variant=f"g{pg}",
                     needs=[("gram", grams)])
        probe_w = _windows(cfg["probe_windows"], L, vocab, 1)
        S.run("ranks", lambda: allocate_probed(model, svds, stats, "probe_select", kept, pg, mult, probe_w),
              variant=f"probe_select-g{pg}", needs=[("gram", grams), ("fisher", stats), ("whitened_svds", svds)])
        del svds

    palu_g = geom.num_kv_heads if cfg["palu_group_size"] == "kv_heads" else int(cfg["palu_group_size"])
    evaluating = any(want(s) for s in EVAL_STEPS)
    methods = [c["name"] for c in cfg["methods"]]
    if not want("decompose"):   # only the checkpoint the Palu methods read, if they are evaluated
        sizes = [palu_g] if evaluating and "palu" in methods else []
    checkpoints = {}
    for g in sizes:
        def decompose(g=g):
            allocation = allocate(geom, kept, g, "uniform", mult)
            factors, report = decompose_model(model, allocation, grams, "whitened", progress=False)
            return allocation, factors, report
        made = S.run("decompose", decompose, variant=f"g{g}", needs=[("gram", grams)])
        if made is None:
            continue
        base = S.run("source_hash", lambda: source_hash(model), variant=f"g{g}")
        out = scratch / f"{name}-palu-g{g}"
        S.run("save_checkpoint", lambda: save_compressed(out, made[1], build_manifest(
            model, name, made[0], "whitened", True, made[2], {}, base_hash=base)), variant=f"g{g}",
              needs=[("source_hash", base)])
        checkpoints[g] = str(out)
    del grams

    state = None
    if want("kvquant") or (evaluating and "kvquant" in methods):
        kv = cfg["kvquant"]
        kv_w = _windows(kv["windows"], L, vocab, 2)
        captured = S.run("kvquant_capture", lambda: capture_activations(
            model, kv_w, fisher=True, tokens_per_window=kv["tokens_per_window"], progress=False),
            tokens=kv_w.numel())
        state_dir = scratch / f"{name}-kvquant"

        def fit():
            fit_from_activations(captured, kv["bits"], "fisher", kv["outlier_fraction"], device=device).save(state_dir)
            return str(state_dir)
        state = S.run("fit_kvquant", fit, variant=f"b{kv['bits']}", needs=[("kvquant_capture", captured)])
        del captured

    ckpt = checkpoints.get(palu_g)
    eval_w = _windows(cfg["eval_windows"], L, vocab, 3)
    eb = cfg.get("eval_batch") or {}
    eval_wb = _windows(eb["windows"], L, vocab, 7) if eb else None
    zs, lc = cfg["zeroshot"], cfg["longcontext"]
    for conf in (cfg["methods"] if evaluating else []):
        label = _label(conf)
        needs = [("decompose", ckpt)] if conf["name"] == "palu" else (
            [("fit_kvquant", state)] if conf["name"] == "kvquant" else [])
        built = S.run("install", lambda: _installed(model, _method(conf, ckpt, state)), variant=label,
                      needs=needs)
        if built is None:
            for step in EVAL_STEPS:
                if want(step):
                    S.run(step, None, variant=label, needs=[("install", None)])
            continue
        m, method = built

        def ppl():
            r = perplexity(m, eval_w, progress=False, make_cache=lambda: method.make_cache(m),
                           cache_nbytes=method.cache_nbytes)
            return r, {"ppl": r["ppl"], "cache_total_bytes": r["cache_nbytes"]["total"]}
        if want("ppl"):
            S.run("ppl", ppl, variant=label, tokens=eval_w.numel())
        if eb and want("ppl_batched"):
            def ppl_batched():
                r = perplexity(m, eval_wb, batch_size=eb["batch"], progress=False,
                               make_cache=lambda: method.make_cache(m))
                return r, {"ppl": r["ppl"], "batch": eb["batch"]}
            S.run("ppl_batched", ppl_batched, variant=label, tokens=eval_wb.numel())

        def requests(count: int, batch: int, seed: int):
            ids = _windows(count, zs["length"], vocab, seed).to(device)
            with torch.no_grad():   # as `method_lm`'s forward: a fresh cache per batch of requests
                for i in range(0, count, batch):
                    m(input_ids=ids[i:i + batch], past_key_values=method.make_cache(m), use_cache=True)
            return None, {"requests": count, "request_tokens": zs["length"], "batch": batch}
        if want("zeroshot"):
            S.run("zeroshot", lambda: requests(zs["requests"], 1, 4), variant=label,
                  tokens=zs["requests"] * zs["length"])
        if want("zeroshot_batched"):
            n = zs["batch_requests"]
            S.run("zeroshot_batched", lambda: requests(n, zs["batch"], 6), variant=label, tokens=n * zs["length"])

        if want("longcontext_batched"):
            B, C, new = lc["batch"], lc["batch_context"], lc["new_tokens"]

            def answer():
                from palu.eval.generation import answer_batches
                prompts = _windows(B, C, vocab, 7).tolist()
                eos, m.generation_config.eos_token_id = m.generation_config.eos_token_id, None
                try:   # EOS off: every row generates its `new` tokens
                    answers = answer_batches(m, tok, method, prompts, new, batch_size=B)
                finally:
                    m.generation_config.eos_token_id = eos
                stored = [b["stored"] for _, b in answers if b]
                return None, {"batch": B, "context": C, "new_tokens": new,
                              "cache_bytes_per_prompt": max(stored) if stored else None}
            S.run("longcontext_batched", answer, variant=label, tokens=B * (C + new))

        if want("longcontext") and conf in lc["methods"]:
            def generate():
                ids = _windows(1, lc["context"], vocab, 5).to(device)
                cache = method.make_cache(m)
                with torch.no_grad():
                    out = m.generate(ids, max_new_tokens=lc["new_tokens"], min_new_tokens=lc["new_tokens"],
                                     do_sample=False, past_key_values=cache, pad_token_id=0)
                return None, {"context": lc["context"], "new_tokens": int(out.shape[1] - ids.shape[1]),
                              "cache_total_bytes": method.cache_nbytes(cache)["total"]}
            S.run("longcontext", generate, variant=label, tokens=lc["context"] + lc["new_tokens"])
        if m is not model:
            del m
        del built
    return S.rows, info


def _installed(model, method):
    """`method` installed on its own copy of the model (an install changes the model in place;
    the FP16 baseline changes nothing and shares it)."""
    if method.name == "fp16":
        return model, method
    m = copy.deepcopy(model)
    method.install(m)
    return m, method


def check_devices(device: str, log) -> list[dict]:
    """The steps moved onto the GPU against the CPU, in float64 on a tiny random Llama: the Gram,
    the whitened factors (each block's reconstruction B A), the probe's spectra and a KVQuant
    codebook fit (largest relative difference of each; the CPU path is the tested reference)."""
    from palu.calib.gram import collect_grams
    from palu.decompose.factors import decompose_model
    from palu.decompose.ranks import allocate
    from palu.decompose.spectra import whitened_svds
    from palu.calib.kvquant import capture_activations, fit_from_activations
    from palu.models.adapters import geometry_of
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=64)
    cpu = LlamaForCausalLM(config).double().eval()
    gpu = copy.deepcopy(cpu).to(device)
    windows = _windows(4, 128, 97, 0)
    rel = lambda a, b: ((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm()).item()
    rows = []
    g_cpu, g_gpu = collect_grams(cpu, windows, False)["gram"], collect_grams(gpu, windows, False)["gram"]
    rows.append({"check": "gram", "rel_diff": rel(g_gpu, g_cpu)})
    geom = geometry_of(config)
    for group in (1, 4):
        allocation = allocate(geom, 0.5, group, "uniform", 8)
        f_cpu, _ = decompose_model(cpu, allocation, g_cpu, progress=False)
        f_gpu, _ = decompose_model(gpu, allocation, g_cpu, progress=False)
        worst = max(rel(B2 @ A2, B1 @ A1) for a, b in zip(f_cpu, f_gpu)
                    for A1, B1, A2, B2 in zip(a.A_k + a.A_v, a.B_k + a.B_v, b.A_k + b.A_v, b.B_k + b.B_v))
        rows.append({"check": f"decompose g{group} (B A per block)", "rel_diff": worst})
        s_cpu, s_gpu = whitened_svds(cpu, g_cpu, group), whitened_svds(gpu, g_cpu, group)
        rows.append({"check": f"whitened spectra g{group}",
                     "rel_diff": max(rel(s_gpu[k][1], s_cpu[k][1]) for k in s_cpu)})
    captured = capture_activations(cpu.float(), windows, fisher=True, tokens_per_window=64, progress=False)
    c_cpu = fit_from_activations(captured, 3, "fisher", 0.01)
    c_gpu = fit_from_activations(captured, 3, "fisher", 0.01, device=device)
    rows.append({"check": "kvquant codebooks (fp16 as stored)",
                 "rel_diff": max(rel(c_gpu.key_codebooks, c_cpu.key_codebooks),
                                 rel(c_gpu.value_codebooks, c_cpu.value_codebooks))})
    for r in rows:
        log(f"check {r['check']}: {device} vs cpu rel diff {r['rel_diff']:.2e}")
    return rows


def run(cfg: dict, out: str | None = None, log=print, shapes: list[str] | None = None) -> dict:
    names = shapes or list(cfg["shapes"])
    unknown = [n for n in names if n not in cfg["shapes"]]
    if unknown:
        raise ValueError(f"shape(s) {unknown} not among {sorted(cfg['shapes'])}")
    if cfg["dtype"] not in _DTYPES:
        raise ValueError(f"dtype={cfg['dtype']!r} is not one of {sorted(_DTYPES)}")
    steps = cfg.get("steps")
    if steps is not None and (not isinstance(steps, list) or not steps or set(steps) - set(STEPS)):
        raise ValueError(f"steps={steps!r}: a non-empty list of {list(STEPS)} (or null: every step)")
    if cfg["device"] == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("the scale benchmark runs on a CUDA GPU (none visible here); "
                           "device=cpu runs it on tiny shapes (its test)")
    checks = check_devices(cfg["device"], log) if cfg["device"] != "cpu" else []
    rows, shapes_info = [], {}
    scratch = Path(tempfile.mkdtemp(prefix="palu-scale-", dir=cfg.get("scratch")))
    try:
        for name in names:
            r, info = run_shape(name, cfg, scratch, log, Path(f"{out}.partial.jsonl") if out else None)
            rows += r
            shapes_info[name] = info
            gc.collect()
            if cfg["device"] == "cuda":
                torch.cuda.empty_cache()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    import transformers
    result = {"device": torch.cuda.get_device_name() if cfg["device"] == "cuda" else platform.processor() or "cpu",
              "rows": rows, "shapes": shapes_info, "config": cfg, "checks": checks,
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                           "python": platform.python_version(), "cuda": torch.version.cuda},
              "weights": "random (transformers' initialisation): times and memory, not quality",
              "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if out:
        from palu.artifacts import write_json
        write_json(out, result)
    return result


def load_config(overrides: list[str] | None = None) -> dict:
    import yaml
    cfg = yaml.safe_load((Path(__file__).resolve().parent / "conf" / "bench" / "scale.yaml").read_text())
    for arg in overrides or []:
        key, _, value = arg.partition("=")
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = yaml.safe_load(value)
    return cfg


def _partial_rows(partial: str) -> list[dict]:
    """The rows of a run's JSON lines (what a run stopped at its time limit leaves)."""
    return [json.loads(line) for line in Path(partial).read_text().splitlines() if line.strip()]


def _check_shapes(rows: list[dict], result: dict, partial: str, described_in: str) -> None:
    stray = sorted({r["shape"] for r in rows} - set(result["shapes"]))
    if stray:
        raise ValueError(f"{partial} measured shapes {stray} that {described_in} does not describe")


def merge_partial(out: str, partial: str, complete: str) -> dict:
    """One result from a run stopped at a call's time limit (its JSON lines, `partial`) and a
    later run on the same machine that measured the rest (`complete`, whose metadata the merged
    file takes): the partial rows first, so the scale table's newest-row rule keeps the later
    run's where both measured a step. Refuses rows of a shape the second run does not describe."""
    from palu.artifacts import read_json, write_json
    rest = read_json(complete)
    lines = _partial_rows(partial)
    if not lines:
        raise ValueError(f"{partial}: no rows")
    _check_shapes(lines, rest, partial, complete)
    merged = {**rest, "rows": lines + rest["rows"],
              "merged": {"partial": Path(partial).name, "complete": Path(complete).name,
                         "note": "rows of two runs on one machine: a run stopped at its time limit "
                                 "(JSON lines), then one that measured the rest; metadata and "
                                 "config of the second"}}
    write_json(out, merged)
    return merged


def add_steps(out: str, partial: str, into: str, steps: list[str], note: str) -> dict:
    """`into` with the rows of `steps` from another run's JSON lines (`partial`: a run stopped at its
    call's limit, say on another machine of the same kind), recorded with `note` beside any earlier
    merge. Refuses a step `into` measured already (the newest-row rule would hide one of them), a
    step `partial` lacks, and a shape `into` does not describe."""
    from palu.artifacts import read_json, write_json
    base = read_json(into)
    rows = [r for r in _partial_rows(partial) if r["step"] in steps]
    missing = sorted(set(steps) - {r["step"] for r in rows})
    if missing:
        raise ValueError(f"{partial} has no rows of {missing}")
    twice = sorted(set(steps) & {r["step"] for r in base["rows"]})
    if twice:
        raise ValueError(f"{into} measured {twice} already")
    _check_shapes(rows, base, partial, into)
    earlier = base.get("merged")
    record = {"partial": Path(partial).name, "steps": list(steps), "rows": len(rows), "note": note}
    merged = {**base, "rows": base["rows"] + rows,
              "merged": ([] if earlier is None else earlier if isinstance(earlier, list) else [earlier]) + [record]}
    write_json(out, merged)
    return merged


if __name__ == "__main__":
    import sys
    if sys.argv[1:2] == ["merge"]:   # python -m palu_bench.scale merge OUT PARTIAL.jsonl COMPLETE.json
        merge_partial(*sys.argv[2:5])
        sys.exit(0)
    if sys.argv[1:2] == ["add"]:     # python -m palu_bench.scale add OUT PARTIAL.jsonl INTO.json STEP[,STEP] NOTE
        add_steps(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5].split(","), sys.argv[6])
        sys.exit(0)
    args = sys.argv[2:]
    only = [a.split("=", 1)[1] for a in args if a.startswith("shape=")]
    cfg = load_config([a for a in args if not a.startswith("shape=")])
    run(cfg, out=sys.argv[1], shapes=only or None)
