"""Greedy decoding of a left-padded batch through a preallocated cache whose decode step is
captured once as a CUDA graph and replayed (issue 49, item 4): the plain model / FP16 path.

Why: on the H200 host an eager decode step of the 30-layer SmolLM2 costs ~90 ms of Python and
kernel launches at any batch size, so a batch of 128 spends ~6 s of its ~8 s launching kernels.
A replayed graph launches the whole step at once. What makes the step capturable:
  - transformers' `StaticCache` (keys / values preallocated for prompt + answer, written in place
    at a device-side counter);
  - the prefill runs the batch right-padded, so plain causal attention (SDPA's flash kernel, no
    mask) keeps each row's tokens from its pads; the decode steps read a mask built here at full
    length (each row's pad slots closed), whose next column is opened on the device;
  - the step's inputs (token, position, cache position) advanced on the device, inside the graph;
  - one host read a step (the new tokens), as the eager loop.
A decode step attends through `grouped_decode_attention`: the query heads of one KV head as one
tile, so the keys and values are read once instead of copied per query head (transformers repeats
them whenever a mask is given); on a GPU through `palu_kernels.dense_decode` (split over the
sequence; SDPA's masked kernel parallelises over rows and heads only), elsewhere through SDPA.

Rows that end stay in the batch until at most half of it is live (`shrink_rows`; a graph has one
shape): then the step's tensors and the cache keep the live rows only, and the step is captured
again at the smaller batch (replayed graphs: only with PALU_STATIC_DECODE=all, see `shrinks`).
Where the model or method does not fit (`unsupported`) the caller keeps the eager loop; where
capture fails, the same static step runs eagerly (logged once). The eager static step is what the
CPU tests compare with the dynamic-cache loop in float64.
"""
from __future__ import annotations

import contextlib
import logging
import os

import torch

from ..attention.grouped_decode import grouped_decode

log = logging.getLogger(__name__)
IMPLEMENTATION = "palu_static"   # the attention implementation name registered below
# families whose attention hands the interface plain (query, key, value, mask, scaling): tested
# in tests/unit/test_static_decode.py (each against its prompts alone, float64)
FAMILIES = {"llama", "mistral", "qwen2", "qwen3", "olmo2", "phi3"}
_warned: set[str] = set()


def enabled() -> bool:
    """Off with PALU_STATIC_DECODE=0 (the eager loop then serves every batch, as before)."""
    return _switch() != "0"


def _switch() -> str:
    value = os.environ.get("PALU_STATIC_DECODE", "1")
    if value not in SWITCH_VALUES:
        raise ValueError(f"PALU_STATIC_DECODE={value!r}: one of {sorted(SWITCH_VALUES)} "
                         "(1: every graph path; all: also graphs recaptured as ended rows leave; palu: "
                         "the plain model's and Palu's; fp16: the plain model's alone; 0: none)")
    return value


# 1 also serves the token-subset methods through their slots (static_subset.py; SnapKV / PyramidKV
# since the H200 check of session 36, the evicting and selecting ones since session 49's) and the
# quantised caches (static_quant.py; since session 38), right-padded prefill included; palu keeps
# those on the eager loop
# all: also ended rows leaving replayed graphs (`shrinks`: checked, but it did not pay at batch 64)
SWITCH_VALUES = {"0", "1", "fp16", "palu", "all"}


def unsupported(model, method) -> str | None:
    """Why this path cannot serve `model` with `method`, or None when it can."""
    if method is not None and getattr(method, "name", None) != "fp16":
        return f"method {getattr(method, 'name', method)!r} has its own cache"
    cfg = model.config
    if cfg.get_text_config(decoder=True) is not cfg:
        return "a composite config (its text model's attention is configured apart)"
    if cfg.model_type not in FAMILIES:
        return f"model type {cfg.model_type!r} (not among {sorted(FAMILIES)})"
    if set(getattr(cfg, "layer_types", None) or ["full_attention"]) != {"full_attention"}:
        return f"layer types {sorted(set(cfg.layer_types))} (a sliding window needs its own mask)"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return f"sliding_window={cfg.sliding_window} (a sliding window needs its own mask)"
    if cfg._attn_implementation not in ("sdpa", "eager"):
        return f"attention implementation {cfg._attn_implementation!r}"
    return None


def grouped_decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                             **kwargs):
    """One query token: each KV head's query heads attend as one group, the keys and values read
    once (`repeat_kv` would copy them per query head every step). Longer queries are the
    prefill of a right-padded batch (`greedy_static`): plain causal attention over the tokens
    written so far, no mask, so SDPA takes its flash kernel."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    B, H, q, D = query.shape
    if q > 1:
        if attention_mask is not None:
            raise ValueError("the static decode path prefills right-padded batches without a mask")
        kwargs.pop("is_causal", None)
        return sdpa_attention_forward(module, query, key[:, :, :q], value[:, :, :q], None, dropout=dropout,
                                      scaling=scaling, is_causal=True, **kwargs)
    out = grouped_decode(query, key, value, attention_mask, scaling if scaling is not None else D ** -0.5)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(**kwargs):
    """The mask transformers would build for a prefill here: none (causal attention over a
    right-padded batch; the decode steps pass their own mask, which transformers passes on)."""
    return None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(IMPLEMENTATION, grouped_decode_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, _no_mask)


_register()


@contextlib.contextmanager
def _attending_grouped(model):
    cfg = model.config
    inner = cfg._attn_implementation
    cfg._attn_implementation = IMPLEMENTATION
    try:
        yield
    finally:
        cfg._attn_implementation = inner


class _Step:
    """One decode step in place on fixed tensors: open the input token's mask column, run the
    model, take the argmax into `tok`, advance the inputs. Capturable: no host reads."""

    def __init__(self, model, cache, first, pos, width: int, mask, opened):
        self.model, self.cache, self.mask, self.opened = model, cache, mask, opened
        self.x = first[:, None].clone()
        self.pos = pos.clone()
        self.cpos = torch.tensor([width], device=first.device)
        self.tok = first.clone()
        self.logits = None

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep the batch's `rows` (a device index, in order): the cache's and the step's."""
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[rows], layer.values[rows]
            layer.batch_size = len(rows)
        self.mask, self.x, self.pos, self.tok = self.mask[rows], self.x[rows], self.pos[rows], self.tok[rows]

    def __call__(self) -> None:
        self.mask.index_fill_(3, self.cpos, self.opened)
        logits = self.model(input_ids=self.x, attention_mask=self.mask, position_ids=self.pos,
                            past_key_values=self.cache, cache_position=self.cpos, use_cache=True,
                            logits_to_keep=1).logits[:, -1]
        self.logits = logits
        self.tok.copy_(logits.argmax(-1))
        self.x.copy_(self.tok[:, None])
        self.pos.add_(1)
        self.cpos.add_(1)


class SlotStep:
    """One decode step of a method whose cache holds preallocated slots (`cache.slots`: the token
    subsets, the quantised caches): run the model on `x` at `pos`, argmax into `x`, advance the
    slots. In place, no host read: capturable."""

    def __init__(self, model, cache, first, pos):
        self.model, self.cache = model, cache
        self.x, self.pos = first[:, None].clone(), pos.clone()
        self.one = torch.ones(first.shape[0], 1, 1, 1, dtype=torch.bool, device=first.device)
        self.logits = None

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep the batch's `rows` (a device index, in order): the slots' and the step's."""
        self.cache.slots.select_rows(rows)
        self.x, self.pos, self.one = self.x[rows], self.pos[rows], self.one[rows]

    def __call__(self) -> None:
        # the 4-D mask is passed through unread: each layer masks its rows by its slots
        self.logits = self.model(input_ids=self.x, position_ids=self.pos, attention_mask=self.one,
                                 past_key_values=self.cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        self.x.copy_(self.logits.argmax(-1)[:, None])
        self.pos.add_(1)
        self.cache.slots.advance()


def _capture(step: _Step):
    """The step as a CUDA graph, after one eager run of it on a side stream (the real next step:
    lazy cuBLAS / allocator set-up happens there, not in the capture); a function replaying it.
    None where capture fails. `step.logits` keeps the eager run's (the capture only records)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    eager_logits = step.logits
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            step()
    except Exception as err:   # noqa: BLE001 - any capture failure falls back to eager steps
        if type(err).__name__ not in _warned:
            _warned.add(type(err).__name__)
            log.warning("CUDA graph capture of the decode step failed (%s: %s); decoding eagerly",
                        type(err).__name__, str(err).splitlines()[0] if str(err) else "")
        torch.cuda.synchronize()
        step.logits = eager_logits
        return None
    replayed, step.logits = step.logits, eager_logits

    def replay():
        graph.replay()
        step.logits = replayed
    return replay


@torch.no_grad()
def greedy_static(model, ids, mask, max_new_tokens: int, stop: set, graph: bool | None = None,
                  trace: list | None = None):
    """Each row's new tokens (cut after its first stop token) and the static cache, for a batch
    `ids` (B, width) whose real tokens `mask` marks (None: all; left padding as `answer_batches`
    pads). The prefill runs the rows right-padded (each row's tokens first, at positions 0, 1, ...,
    its pads after them), so causal attention alone keeps every real token from the pads and no
    mask is built; the decode steps then mask each row's pad slots. `graph`: capture the decode
    step (default: on a GPU). `trace`: gets each step's logits (tests)."""
    from transformers import StaticCache
    B, width = ids.shape
    device = ids.device
    total = width + max_new_tokens
    valid = torch.ones(B, width, dtype=torch.bool, device=device) if mask is None else mask.bool()
    lengths = valid.sum(-1)
    order = torch.argsort((~valid).to(torch.int8), dim=-1, stable=True)   # real tokens first
    ids = ids.gather(1, order)
    graph = device.type == "cuda" if graph is None else graph
    cache = StaticCache(config=model.config, max_cache_len=total)
    with _attending_grouped(model):
        steps = torch.arange(width, device=device)
        hidden = model.get_decoder()(input_ids=ids, position_ids=steps.expand(B, -1), past_key_values=cache,
                                     cache_position=steps, use_cache=True).last_hidden_state
        logits = model.get_output_embeddings()(hidden[torch.arange(B, device=device), lengths - 1])
        del hidden
        if trace is not None:
            trace.append(logits)
        decode_mask = torch.zeros(B, 1, 1, total, dtype=torch.bool, device=device)
        decode_mask[:, 0, 0, :width] = steps < lengths[:, None]
        first = logits.argmax(-1)
        step = _Step(model, cache, first, lengths[:, None].clone(), width, decode_mask, True)
        new = replay_steps(step, lambda: step.tok, first, max_new_tokens, stop, graph, trace)
    return new, cache


# a batch drops its ended rows once at most this share of it is live and at least SHRINK_STEPS
# steps remain (for replayed graphs a new capture, one eager step and the capture, must then be
# paid for by the steps of the smaller batch: at batch 64 on an H100 it was not, see `shrinks`)
SHRINK_LIVE = 0.5
SHRINK_STEPS = 4


def shrinks(graph: bool) -> bool:
    """Whether ended rows leave a batch decoded by replayed graphs (`graph`) or by the same steps
    run eagerly: eager steps always (the float64 tests' path); graphs, captured again at each new
    batch, only with PALU_STATIC_DECODE=all: on an H100 they answered as the full batch but did not
    pay at batch 64 x 1-4K prompts + 64 tokens (the prefill dominates; a capture costs about what
    half a batch saves; results/checks/h100-shrink-check-random-session48.json)."""
    return not graph or _switch() == "all"


def shrink_rows(done: list, live: list, k: int, max_new_tokens: int) -> list[int] | None:
    """The places in the batch (whose rows are `live`, indices into `done`) of the rows to keep
    after step k, or None to keep the batch as it is."""
    keep = [i for i, r in enumerate(live) if not done[r]]
    if not keep or len(keep) > SHRINK_LIVE * len(live) or max_new_tokens - 1 - k < SHRINK_STEPS:
        return None
    return keep


def with_all_rows(logits: torch.Tensor, live: list, batch: int) -> torch.Tensor:
    """A step's logits of the live rows placed in the whole batch's (NaN at dropped rows): a trace
    keeps one shape."""
    if len(live) == batch:
        return logits.clone()
    full = logits.new_full((batch, logits.shape[-1]), float("nan"))
    full[torch.as_tensor(live, device=logits.device)] = logits
    return full


def replay_steps(step, tokens, first, max_new_tokens: int, stop: set, graph: bool, trace: list | None,
                 leaving=None):
    """Each row's new tokens from `first` on: `step()` run once eagerly and captured (`graph`), then
    replayed, until every row has stopped or `max_new_tokens` are out; `tokens()` the step's new
    tokens (one per live row), `step.logits` its logits (appended to `trace`, NaN at rows gone).
    A step with `select_rows` loses its ended rows as `shrink_rows` says (then captured again).
    `leaving(rows)`: told of each row as it leaves the batch and of the rest at the end, as
    (index in `new`, place in the batch, tokens decoded), for the bytes a row holds when it ends."""
    new = [[t] for t in first.tolist()]
    done = [t in stop for t, in new]
    live = list(range(len(new)))     # the step's rows: their indices in `new`
    replay = None
    shrinking = hasattr(step, "select_rows") and shrinks(graph)
    for k in range(1, max_new_tokens):
        if all(done):
            break
        if replay is None and graph:
            replay = _capture(step)   # runs step k eagerly first
            graph = replay is not None
        elif replay is None:
            step()
        else:
            replay()
        if trace is not None:
            trace.append(with_all_rows(step.logits, live, len(new)))
        for i, t in enumerate(tokens().tolist()):
            r = live[i]
            if not done[r]:
                new[r].append(t)
                done[r] = t in stop
        keep = shrink_rows(done, live, k, max_new_tokens) if shrinking else None
        if keep is not None:
            if leaving is not None:
                kept = set(keep)
                leaving([(r, i, len(new[r])) for i, r in enumerate(live) if i not in kept])
            step.select_rows(torch.tensor(keep, device=first.device))
            live = [live[i] for i in keep]
            replay = None
    if leaving is not None:
        leaving([(r, i, len(new[r])) for i, r in enumerate(live)])
    return new


def latent_enabled() -> bool:
    """Palu through `GraphLatentCache` and replayed steps: on unless PALU_STATIC_DECODE is 0 or
    fp16 (the eager `LatentCache` loop then). Checked on the H200 (session 35,
    `results/checks/h200-static-latent-check.json`): the replayed steps equal the same steps run
    eagerly, and the right-padded prefill equals each prompt alone in fp16, where the loop's
    left-padded one is 0.9-2.2 logits apart."""
    return _switch() in ("1", "palu", "all")


def latent_unsupported(model, method) -> str | None:
    """Why the latent graph path cannot serve `method` on `model`, or None."""
    from ..methods.palu import Palu
    if type(method) is not Palu:   # its compositions (selection, eviction) keep their own caches
        return f"method {getattr(method, 'name', method)!r} is not plain Palu"
    if getattr(method, "channel_group", None) is not None:
        return "channel-grouped latent quantisation"
    widths = method.layer_bits()
    if isinstance(widths, list) and len(set(widths)) > 1:
        return "mixed latent widths"
    from ..cache.graph_cache import GraphLatentCache
    return GraphLatentCache.unsupported(model, widths[0] if isinstance(widths, list) else widths)


@torch.no_grad()
def greedy_static_latent(model, method, ids, mask, max_new_tokens: int, stop: set,
                         graph: bool | None = None, trace: list | None = None):
    """`greedy_static` for Palu: the latents in a `GraphLatentCache` (preallocated slots, each
    row masked by its own length), the batch prefilled right-padded, then one token a row a step
    at the row's own slot, the step replayed as a CUDA graph per bucket of slots read
    (`palu.graph_decoding`); ended rows leave as `shrink_rows` says. Returns each row's new tokens
    and the cache (of the rows still held)."""
    from ..cache.graph_cache import GraphLatentCache
    from ..graph_decoding import CapturedStep, bucket_tokens
    B, width = ids.shape
    device = ids.device
    valid = torch.ones(B, width, dtype=torch.bool, device=device) if mask is None else mask.bool()
    lengths = valid.sum(-1)
    ids = ids.gather(1, torch.argsort((~valid).to(torch.int8), dim=-1, stable=True))
    graph = device.type == "cuda" if graph is None else graph
    widths = method.layer_bits()
    bits = widths[0] if isinstance(widths, list) else widths
    cache = GraphLatentCache(model, max_tokens=width + max_new_tokens, batch=B, bits=bits)
    steps = torch.arange(width, device=device)
    hidden = model.get_decoder()(input_ids=ids, position_ids=steps.expand(B, -1), past_key_values=cache,
                                 use_cache=True).last_hidden_state
    logits = model.get_output_embeddings()(hidden[torch.arange(B, device=device), lengths - 1])
    del hidden
    if trace is not None:
        trace.append(logits)
    cache.set_row_lengths(lengths)
    x = logits.argmax(-1)[:, None].clone()
    pos = lengths[:, None].clone()
    one = torch.ones(B, 1, 1, 1, dtype=torch.bool, device=device)   # passed through; rows masked by length
    out = {}

    def step():
        out["logits"] = model(input_ids=x, position_ids=pos, attention_mask=one, past_key_values=cache,
                              use_cache=True, logits_to_keep=1).logits[:, -1]
        return out["logits"]
    new = [[t] for t in x[:, 0].tolist()]
    done = [t in stop for t, in new]
    live = list(range(B))     # the batch's rows: their indices in `new`
    shrinking = shrinks(graph)
    graphs: dict[int, object] = {}
    for k in range(1, max_new_tokens):
        if all(done):
            break
        if graph:
            bucket = bucket_tokens(cache.seen + 1, cache.max_tokens)
            if bucket not in graphs:
                cache.view_tokens = bucket
                try:   # the warm-up runs the step (repeatably: same slots, same inputs)
                    graphs[bucket] = CapturedStep(step)
                except Exception as err:   # noqa: BLE001 - any capture failure: eager steps
                    log.warning("CUDA graph capture of the Palu decode step failed (%s); decoding eagerly", err)
                    graph = False
                finally:
                    cache.view_tokens = None
            if graph:
                cache.view_tokens = bucket
                logits = graphs[bucket]()
                cache.view_tokens = None
                cache.seen += 1
        if not graph:
            logits = step()
        if trace is not None:
            trace.append(with_all_rows(logits, live, B))
        tok = logits.argmax(-1)
        for i, t in enumerate(tok.tolist()):
            r = live[i]
            if not done[r]:
                new[r].append(t)
                done[r] = t in stop
        x.copy_(tok[:, None])
        pos.add_(1)
        keep = shrink_rows(done, live, k, max_new_tokens) if shrinking else None
        if keep is not None:   # the ended rows leave; each bucket is captured again at the new batch
            rows = torch.tensor(keep, device=device)
            cache.select_rows(rows)
            x, pos, one = x[rows], pos[rows], one[rows]
            live = [live[i] for i in keep]
            graphs.clear()
    return new, cache


def latent_row_bytes(method, model, tokens: int) -> dict:
    """What `method`'s own cache (`make_cache`, a LatentCache) holds for one row of `tokens`
    tokens, counted by the method (`cache_nbytes`): the bytes a row of the eager path reports."""
    from ..cache.protocol import check_latent_model
    cache = method.make_cache(model)
    for i, attn in sorted(check_latent_model(model, "latent_row_bytes").items()):
        zeros = attn.A_k.new_zeros
        cache.update_latent(zeros(1, tokens, sum(attn.ranks_k)), zeros(1, tokens, sum(attn.ranks_v)),
                            torch.arange(tokens, device=attn.A_k.device)[None], i,
                            ranks=(list(attn.ranks_k), list(attn.ranks_v)), dequantize=False)
    n = method.cache_nbytes(cache)
    return {"stored": int(round(n["total"])), "read_per_step": int(round(n.get("read_per_step", n["total"]))),
            "tokens": int(tokens)}


def latent_rows_bytes(method, model, token_counts) -> dict[int, dict]:
    """`latent_row_bytes` of every count in `token_counts`, measured three times, not once a count:
    a LatentCache holds latents, scales, zero points and positions per token, so a row's bytes
    are affine in its tokens. Measured at 1 and 2 tokens and at the largest count, which must lie
    on their line; a cache whose bytes do not (a future method's per-page metadata, say) is
    measured at every count instead, and says so. Measuring each of a batch's 64 lengths cost
    3,840 quantise launches and their copies a batch (the H100 step profile of session 42)."""
    counts = sorted(set(int(t) for t in token_counts))
    if len(counts) <= 3:
        return {t: latent_row_bytes(method, model, t) for t in counts}
    one, two, top = (latent_row_bytes(method, model, t) for t in (1, 2, counts[-1]))

    def line(t):
        return {k: one[k] + (t - 1) * (two[k] - one[k]) for k in ("stored", "read_per_step", "tokens")}
    if line(counts[-1]) != top:
        log.warning("%s: a row's cache bytes are not affine in its tokens (%s at %d tokens, the line "
                    "through 1 and 2 gives %s): measured at each of %d lengths", method.tag, top,
                    counts[-1], line(counts[-1]), len(counts))
        return {t: latent_row_bytes(method, model, t) for t in counts}
    return {t: line(t) for t in counts}
