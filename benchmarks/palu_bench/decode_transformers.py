"""The transformers path on a GPU: time per generated token as a user of `palu` runs it.

`LlamaForCausalLM` at the benchmark's shape (random fp16 weights), dense with transformers'
`StaticCache` (preallocated, written in place) or `DynamicCache` (`generate`'s default, which
concatenates: every step copies the whole cache) vs the same model with Palu attention
installed (`install_palu`, random factors of the configured ranks: decode time does not depend
on the values) and `palu.LatentCache` (fp16 or packed latents). Each step is
`model(input_ids=..., past_key_values=cache)` in eager mode, as `generate` runs it: Python,
per-layer launches and the cache's append included.
Variants with `graph: true` replay each step as a CUDA graph instead: Palu through
`palu.GraphLatentCache` and `palu.GraphDecoder` (what a user of the library runs for speed), dense
through transformers' `StaticCache` captured the same way (its device-side length counter and
mask make its step capturable). The graph-replayed decoder (`palu_bench.bench_decoder`) is the kernels'
best case with a hand-written model; these are the same kernels inside transformers' model.

Before timing, `check` runs one step through the kernels and through the torch reference path on
two copies of the same cache and reports the logits' relative error (and that the kernels ran).
"""
from __future__ import annotations

import gc
from contextlib import contextmanager

import torch

from palu.attention.install import install_palu, set_backend
from palu.cache.graph_cache import GraphLatentCache
from palu.cache.latent_cache import LatentCache
from palu.decompose.factors import LayerFactors
from palu.graph_decoding import CapturedStep, GraphDecoder
from .bench_decoder import DecoderShape, PaluSpec


@contextmanager
def _default_dtype(dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def hf_llama(shape: DecoderShape, device, seed: int = 0):
    """A LlamaForCausalLM of `shape` with transformers' random init, fp16, on `device`."""
    from transformers import LlamaConfig, LlamaForCausalLM
    if not shape.rope:
        raise ValueError("the transformers benchmark runs Llama models, which always use RoPE (rope: true)")
    cfg = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                      num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                      num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
                      rope_theta=shape.rope_theta, rms_norm_eps=shape.eps, max_position_embeddings=1 << 20,
                      attn_implementation="sdpa", tie_word_embeddings=False)
    torch.manual_seed(seed)
    with _default_dtype(torch.float16), torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model.eval()


def random_factors(shape: DecoderShape, spec: PaluSpec, device, seed: int = 0) -> list[LayerFactors]:
    """Per layer and group: A (r, hidden) and B (group_size * head_dim, r), Gaussian, scaled so
    latents and rebuilt keys keep the size of their inputs."""
    gen = torch.Generator(device).manual_seed(seed)
    rows, groups = spec.group_size * shape.head_dim, shape.kv_heads // spec.group_size

    def rand(*size):
        return torch.randn(*size, generator=gen, device=device) / size[-1] ** 0.5

    out = []
    for _ in range(shape.layers):
        lf = LayerFactors()
        for _ in range(groups):
            lf.A_k.append(rand(spec.rank_k, shape.hidden))
            lf.B_k.append(rand(rows, spec.rank_k))
            lf.A_v.append(rand(spec.rank_v, shape.hidden))
            lf.B_v.append(rand(rows, spec.rank_v))
        out.append(lf)
    return out


CACHES = ("static", "dynamic")


def new_cache(model, bits: int, palu: bool, kind: str = "static", max_tokens: int = 0,
              graph: bool = False, batch: int = 1):
    """LatentCache for a Palu model (GraphLatentCache of `max_tokens` slots with `graph`); else
    transformers' StaticCache (room for `max_tokens`) or DynamicCache."""
    from transformers import DynamicCache, StaticCache
    if palu:
        return GraphLatentCache(model, max_tokens, batch, bits) if graph else LatentCache(model, bits=bits)
    if kind not in CACHES:
        raise ValueError(f"dense cache {kind!r} is not one of {CACHES}")
    return (StaticCache(config=model.config, max_cache_len=max_tokens) if kind == "static"
            else DynamicCache(config=model.config))


@torch.no_grad()
def fill_cache(model, cache, context: int, batch: int, seed: int = 0) -> None:
    """`context` tokens of random contents in every layer (a prefill's result, without the
    prefill's time): keys/values for a dense cache, latents for a LatentCache."""
    from palu.attention.palu_attention import PaluAttention
    gen = torch.Generator(model.device).manual_seed(seed)
    cfg = model.config
    positions = torch.arange(context, device=model.device)[None]
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        if isinstance(attn, PaluAttention):
            hk, hv = (torch.randn(batch, context, sum(r), generator=gen, device=model.device,
                                  dtype=torch.float16) for r in (attn.ranks_k, attn.ranks_v))
            if isinstance(cache, GraphLatentCache):
                cache.update_latent(hk, hv, positions, i)
            else:
                cache.update_latent(hk, hv, positions, i, ranks=(attn.ranks_k, attn.ranks_v), dequantize=False)
        else:
            k, v = (torch.randn(batch, cfg.num_key_value_heads, context, cfg.head_dim, generator=gen,
                                device=model.device, dtype=torch.float16) for _ in range(2))
            cache.update(k, v, i)


def _step_function(model, cache, batch: int, context: int, graph: bool):
    """f(tokens (B, 1)) -> logits (B, vocab) of the next step: eager `model(...)`, or with
    `graph` a replayed CUDA graph (GraphDecoder for Palu; a captured StaticCache step for dense,
    whose device-side counter advances the position at every replay, warm-up calls included)."""
    if not graph:
        def eager(tokens):
            return model(input_ids=tokens, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        return eager
    if isinstance(cache, GraphLatentCache):
        decoder, position = GraphDecoder(model, cache), iter(range(context, cache.max_tokens))
        return lambda tokens: decoder.step(tokens[:, 0], next(position))
    ids = torch.zeros(batch, 1, dtype=torch.long, device=model.device)
    step = CapturedStep(lambda: model(input_ids=ids, past_key_values=cache, use_cache=True,
                                      logits_to_keep=1).logits[:, -1])

    def replay(tokens):
        ids.copy_(tokens)
        return step()
    return replay


@torch.no_grad()
def time_steps(model, cache, batch: int, steps: int, warmup: int = 3, context: int = 0,
               graph: bool = False) -> list[float]:
    """Seconds of each of `steps` greedy decode steps (after `warmup` untimed ones) with
    `context` tokens cached. Python's cyclic garbage collector is off while timing: its pauses
    (measured on the H200 host: median 92 -> 67 ms/token for one configuration) are noise, not a
    property of either cache."""
    tokens = torch.zeros(batch, 1, dtype=torch.long, device=model.device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    collecting = gc.isenabled()
    gc.disable()
    try:
        step = _step_function(model, cache, batch, context, graph)
        for i in range(warmup + steps):
            start.record()
            tokens = step(tokens).argmax(-1, keepdim=True)
            end.record()
            end.synchronize()
            if i >= warmup:
                times.append(start.elapsed_time(end) * 1e-3)
    finally:
        if collecting:
            gc.enable()
    return times


@torch.no_grad()
def check(model, bits: int, context: int, batch: int, graph: bool = False) -> dict:
    """One decode step through the kernels and through the torch path, same cache contents.
    With `graph` the kernels' step is a captured CUDA graph over a GraphLatentCache (reading a
    bucket of slots masked by length), the torch path an eager step over the same cache kind."""
    from palu.attention import kernel_backend
    calls, real = [], kernel_backend.kernel_decode

    def counted(attn, *args, **kwargs):
        calls.append(attn.layer_idx)
        return real(attn, *args, **kwargs)
    tokens = torch.arange(batch, device=model.device)[:, None]
    logits = {}
    kernel_backend.kernel_decode = counted
    try:
        for backend in ("triton", "torch"):   # on a GPU "triton" = "auto" for fp16 models
            set_backend(model, backend)
            cache = new_cache(model, bits, palu=True, max_tokens=context + 8, graph=graph, batch=batch)
            fill_cache(model, cache, context, batch, seed=1)
            if graph and backend == "triton":
                out = GraphDecoder(model, cache).step(tokens[:, 0], context)
            else:
                out = model(input_ids=tokens, past_key_values=cache, use_cache=True,
                            logits_to_keep=1).logits[:, -1]
            logits[backend] = out.float()
    finally:
        kernel_backend.kernel_decode = real
        set_backend(model, "auto")
    ref = logits["torch"]
    err = ((logits["triton"] - ref).norm() / ref.norm()).item()
    return {"bits": bits, "context": context, "graph": graph, "rel_err": err,
            "kernel_layers": len(set(calls))}


def _measure(model, bits, palu: bool, kind: str, context: int, batch: int, steps: int,
             graph: bool = False) -> dict:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    warmup = 3
    # dense graph steps: two more warm-up calls advance StaticCache's counter (CapturedStep)
    cache = new_cache(model, bits, palu, kind, context + warmup + steps + 2, graph, batch)
    fill_cache(model, cache, context, batch)
    times = sorted(time_steps(model, cache, batch, steps, warmup, context, graph))
    if isinstance(cache, GraphLatentCache):
        held = cache.nbytes()
    elif palu:
        held = cache.nbytes()["reserved"]
    else:
        held = sum(t.numel() * t.element_size() for lay in cache.layers for t in (lay.keys, lay.values))
    peak = torch.cuda.max_memory_allocated() - resident
    del cache
    return {"seconds_per_token": times[len(times) // 2], "seconds_min": times[0],
            "peak_over_weights_bytes": peak, "cache_bytes": held}


def hf_plan(cfg: dict) -> tuple[DecoderShape, dict, dict]:
    """Validated (shape, {variant: PaluSpec or None}, {variant: dense cache kind}) of the decode
    config's `hf` block: {contexts, steps, baseline, variants: [{name, cache: static | dynamic}
    (dense) or {name, palu: {group_size, kept_k, kept_v, bits}}, optionally `graph: true` and
    `baseline` (the variant its speed-up is over; default hf.baseline)]}."""
    hf = cfg["hf"]
    shape = DecoderShape(**cfg["shape"], rope=True)
    names = [v["name"] for v in hf["variants"]]
    if len(set(names)) != len(names):
        raise ValueError(f"hf variant names must be unique: {names}")
    specs = {v["name"]: (None if v.get("palu") is None else PaluSpec.from_kept(
        shape, v["palu"]["group_size"], v["palu"]["kept_k"], v["palu"]["kept_v"], v["palu"].get("bits", 16)))
        for v in hf["variants"]}
    kinds = {v["name"]: v.get("cache", "static") for v in hf["variants"]}
    for name, kind in kinds.items():
        if specs[name] is None and kind not in CACHES:
            raise ValueError(f"hf variant {name!r}: cache {kind!r} is not one of {CACHES}")
    for v in hf["variants"]:
        if not isinstance(v.get("graph", False), bool):
            raise ValueError(f"hf variant {v['name']!r}: graph={v['graph']!r} must be true or false")
        if v.get("graph") and v.get("palu") is None and kinds[v["name"]] != "static":
            raise ValueError(f"hf variant {v['name']!r}: a CUDA graph needs the static dense cache, "
                             f"not {kinds[v['name']]!r}")
    for where, base in [("hf.baseline", hf["baseline"])] + [
            (f"hf variant {v['name']!r}: baseline", v["baseline"]) for v in hf["variants"] if "baseline" in v]:
        if base not in specs:
            raise ValueError(f"{where} {base!r} is not one of the variants {names}")
    return shape, specs, kinds


def run_hf(cfg: dict, log=print) -> dict:
    """The `hf` block of the decode benchmark's config (`hf_plan`) timed on this GPU."""
    hf, batch = cfg["hf"], cfg["batch"]
    shape, specs, kinds = hf_plan(cfg)
    model = hf_llama(shape, "cuda")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    rows, checks, installed = [], [], None
    graphs = {v["name"]: bool(v.get("graph", False)) for v in hf["variants"]}
    # dense first, then the Palu variants grouped by their factorisation (installed in place)
    for name, spec in sorted(specs.items(), key=lambda kv: kv[1] is not None):
        if spec is not None and installed != (spec.group_size, spec.rank_k, spec.rank_v):
            if installed is not None:
                del model
                gc.collect()
                model = hf_llama(shape, "cuda")
            install_palu(model, random_factors(shape, spec, "cuda"), spec.group_size)
            installed = (spec.group_size, spec.rank_k, spec.rank_v)
            weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        bits = 16 if spec is None else spec.bits
        if spec is not None and hf.get("check_context"):
            c = {"variant": name, **check(model, bits, hf["check_context"], batch, graphs[name])}
            log(f"hf check {name}: kernels vs torch path, rel err {c['rel_err']:.2e} "
                f"({c['kernel_layers']} layers through the kernels)")
            checks.append(c)
        for context in hf["contexts"]:
            row = {"variant": name, "context": context, "batch": batch, "weight_bytes": weights,
                   "cache": ("graph-latent" if graphs[name] else "latent") if spec else kinds[name],
                   "graph": graphs[name],
                   "group_size": spec.group_size if spec else None, "rank_k": spec.rank_k if spec else None,
                   "rank_v": spec.rank_v if spec else None, "bits": spec.bits if spec else 16}
            try:
                row.update(_measure(model, bits, spec is not None, kinds[name], context, batch, hf["steps"],
                                    graphs[name]))
                log(f"hf {name} T={context}: {row['seconds_per_token'] * 1e3:.2f} ms/token, "
                    f"cache {row['cache_bytes'] / 2**30:.1f} GiB")
            except torch.OutOfMemoryError as err:
                row["error"] = f"out of memory: {str(err)[:160]}"
            except Exception as err:   # recorded, the run goes on
                row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
                log(f"hf {name} T={context}: {row['error']}")
            rows.append(row)
            torch.cuda.empty_cache()
    # speed-ups over the variant's own `baseline` (e.g. graph rows over the dense graph row)
    baselines = {v["name"]: v.get("baseline", hf["baseline"]) for v in hf["variants"]}
    times = {(r["variant"], r["context"]): r["seconds_per_token"] for r in rows if "error" not in r}
    for r in rows:
        base = times.get((baselines[r["variant"]], r["context"]))
        r["baseline"] = baselines[r["variant"]]
        if "error" not in r and base is not None:
            r["speedup"] = base / r["seconds_per_token"]
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return {"rows": rows, "checks": checks, "baseline": hf["baseline"]}
