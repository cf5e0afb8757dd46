"""`search` (issue 53): ranks moved by the measured LM loss, not chosen by a loss model.

probe_select picks the best of a few statistics-based allocations; where none is good it cannot do
better. `search` starts from probe_select's choice and moves ranks between blocks by what the
truncated model's loss (each K / V block at its rank, the unquantised Palu model) says on *search
windows*: every round it measures, for each block, the loss of giving up one unit of `multiple`
dims and of taking one more (2 evaluations a block), then tries the pairs (donor, receiver) in the
order those marginals predict, each verified by one evaluation and kept only if the loss falls,
each block moved at most once a round; it stops when a round keeps nothing or the evaluations run
out. The total rank, so the bytes of every latent width, never changes; ranks stay multiples of
`multiple` in 1 unit .. the block's full rank. Deterministic: no sampling.

Search windows must be text that neither the Gram nor the Fisher windows read, nor any evaluation
(`held_out_windows` cuts them from the calibration text's unread spans; the evaluation text is
another split). The windows used are recorded in the allocation (`search.windows`).
"""
from __future__ import annotations

import logging
import math
import re
import time

import torch

from ..models.adapters import adapter_for, geometry_of
from .ranks import Allocator, Slot, register_allocator, register_variants

EVALUATIONS = 400      # loss evaluations a search may spend (probe_select's start included)
WINDOW_TOKENS = 512    # search window length
WINDOWS = 4            # search windows (2,048 tokens)
log = logging.getLogger(__name__)


def held_out_windows(tokens: torch.Tensor, drawn: list[tuple[list[int], int]], seqlen: int = WINDOW_TOKENS,
                     n: int = WINDOWS, bos: int | None = None) -> tuple[torch.Tensor, list[int]]:
    """Up to `n` windows of `seqlen` tokens (`bos` first, as `data.windows` makes them) cut, in
    order, from the text that none of the `drawn` windows reads ((start offsets, text length) per
    draw: the Gram's and the Fisher's). Returns the windows and their start offsets; refused by
    name when not even one fits."""
    text = seqlen - (bos is not None)
    free = torch.ones(tokens.numel(), dtype=torch.bool)
    for offsets, length in drawn:
        for s in offsets:
            free[s:s + length] = False
    # runs of unread tokens: [start, end) where `free` turns on and off
    edges = torch.diff(torch.cat([torch.zeros(1), free.float(), torch.zeros(1)])).nonzero().flatten().tolist()
    starts = []
    for run_start, run_end in zip(edges[::2], edges[1::2]):
        for s in range(run_start, run_end - text + 1, text):
            if len(starts) < n:
                starts.append(s)
    if not starts:
        raise ValueError(f"no {seqlen}-token search window fits in the calibration text that the Gram "
                         f"and Fisher windows leave unread ({int(free.sum())} tokens): shorten the "
                         "windows or draw fewer calibration windows")
    windows = torch.stack([tokens[s:s + text] for s in starts])
    if bos is not None:
        windows = torch.cat([torch.full((len(starts), 1), bos, dtype=windows.dtype), windows], 1)
    return windows, starts


class _Truncation:
    """The model with each K / V block at a rank, one block rewritten at a time; restored on exit."""

    def __init__(self, model, svds: dict, group_size: int):
        adapter, geom = adapter_for(model.config), geometry_of(model.config)
        self.svds, self.rows = svds, group_size * geom.head_dim
        self.proj, self.saved = {}, []
        for l, layer in enumerate(adapter.layers(model)):
            _, k, v, _ = adapter.projections(adapter.attention(layer))
            for kind, p in (("k", k), ("v", v)):
                self.proj[(l, kind)] = p
                self.saved.append((p, p.weight.data.clone()))

    def set(self, slot: Slot, rank: int) -> None:
        U, sigma, V = self.svds[slot]
        p = self.proj[(slot.layer, slot.kind)]
        block = (U[:, :rank] * sigma[:rank]) @ V[:rank]
        p.weight.data[slot.group * self.rows:(slot.group + 1) * self.rows] = block.to(p.weight.dtype)

    def restore(self) -> None:
        for p, w in self.saved:
            p.weight.data.copy_(w)


def _copy(out):
    """A layer's output (a tensor, or a tuple holding tensors) copied, so no later in-place use
    by the next layer reaches what is kept."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if type(out) is tuple:
        return tuple(_copy(o) for o in out)
    return out


class _KeptPrefix:
    """Each decoder layer's output on every search window under the current ranks, so that an
    evaluation whose changed blocks all lie in layer `first` or later runs layers first.. alone:
    the layers before it hand back what they computed from the same inputs with the same weights
    (the loss a whole forward gives, bit for bit). Outputs are kept as evaluations pass: a run
    from layer f whose lowest changed layer is l records layers f..l-1 (unchanged there, so the
    current ranks'); a kept move makes every output from its lowest layer on stale. No evaluation
    is added, so the search's path and its count of evaluations are what a whole forward each
    gives. Saves the layers below the changed block: on SmolLM2 about 40% of an evaluation on
    average (the body before it; the embedding and LM head always run)."""

    def __init__(self, model, windows: torch.Tensor):
        self.model, self.windows = model, windows
        self.layers = list(adapter_for(model.config).layers(model))
        self.kept = [[None] * len(windows) for _ in self.layers]
        self.valid = 0          # outputs of layers < valid are the current ranks'
        self.window = 0

    def loss(self, changed_from: int) -> float:
        """The probe loss with every changed block in layer `changed_from` or later."""
        from .probe import probe_loss
        first = min(changed_from, self.valid)
        record = range(first, changed_from)
        saved, hooks = [], []
        for i in range(first):
            layer = self.layers[i]
            # an instance-level forward (accelerate's dispatch hooks set one) is put back after
            saved.append((layer, layer.__dict__.get("forward")))
            layer.forward = (lambda i: lambda *args, **kwargs: _copy(self.kept[i][self.window]))(i)
        for i in record:
            hooks.append(self.layers[i].register_forward_hook(
                (lambda i: lambda module, args, out: self._keep(i, out))(i)))
        try:
            loss = probe_loss(self.model, self.windows, before_window=self._at)
        finally:
            for layer, own in saved:
                if own is None:
                    del layer.forward      # the class's forward again
                else:
                    layer.forward = own
            for h in hooks:
                h.remove()
        self.valid = max(self.valid, changed_from)
        return loss

    def moved(self, layer: int) -> None:
        """A move kept in `layer` (and maybe later ones): outputs from there on are stale."""
        self.valid = min(self.valid, layer)

    def _at(self, window: int) -> None:
        self.window = window

    def _keep(self, i: int, out) -> None:
        self.kept[i][self.window] = _copy(out)


def search_ranks(model, svds: dict, stats: dict, kept_ratio: float, group_size: int, multiple: int,
                 windows: torch.Tensor, evaluations: int = EVALUATIONS, reuse_layers: bool = True) -> dict:
    """probe_select's allocation on `windows`, then ranks moved by measured loss (module docstring).
    Returns the allocation labelled `search`, with its start, its loss at each accepted move and
    the evaluations spent under "search"."""
    from .probe import probe_select
    if evaluations < 1:
        raise ValueError(f"search evaluations={evaluations!r} must be a positive number")
    began = time.perf_counter()
    start = probe_select(model, svds, stats, kept_ratio, group_size, multiple, windows)
    log.info("search: probe_select's start in %.1f s", time.perf_counter() - began)
    began = time.perf_counter()
    spent = len(start["probe"]["candidates"])
    ranks = {Slot(r["layer"], r["kind"], r["group"]): r["rank"] for r in start["ranks"]}
    full = {Slot(r["layer"], r["kind"], r["group"]): r["full"] for r in start["ranks"]}
    order = list(ranks)
    t = _Truncation(model, svds, group_size)
    prefix = _KeptPrefix(model, windows)
    layers = len(prefix.layers)

    def measure(changed_from: int) -> float:
        return prefix.loss(changed_from if reuse_layers else 0)
    history = []
    try:
        for s in order:
            t.set(s, ranks[s])
        loss = measure(layers)      # a whole forward, every layer's output kept
        spent += 1
        history.append({"evaluations": spent, "loss": loss, "moves": 0})
        while spent < evaluations:
            cost, gain = {}, {}
            for s in order:   # each block's marginals: one unit less, one unit more
                for delta, out in ((-multiple, cost), (multiple, gain)):
                    r = ranks[s] + delta
                    if spent >= evaluations or not multiple <= r <= full[s]:
                        continue
                    t.set(s, r)
                    out[s] = measure(s.layer) - loss
                    spent += 1
                    t.set(s, ranks[s])
                    if spent % max(1, evaluations // 10) == 0:   # a round can be the whole budget
                        log.info("search round %d: %d of %d evaluations (marginals of %d blocks)",
                                 len(history), spent, evaluations, len(order))
            pairs = sorted((cost[d] + gain[g], i, j, d, g) for i, d in enumerate(order) if d in cost
                           for j, g in enumerate(order) if g in gain and g != d)
            moved, touched = 0, set()
            for predicted, _, _, d, g in pairs:
                if predicted >= 0 or spent >= evaluations:
                    break
                if d in touched or g in touched:
                    continue
                t.set(d, ranks[d] - multiple)
                t.set(g, ranks[g] + multiple)
                trial = measure(min(d.layer, g.layer))
                spent += 1
                if trial < loss:
                    ranks[d] -= multiple
                    ranks[g] += multiple
                    prefix.moved(min(d.layer, g.layer))
                    loss, moved = trial, moved + 1
                    touched |= {d, g}
                else:
                    t.set(d, ranks[d])
                    t.set(g, ranks[g])
            history.append({"evaluations": spent, "loss": loss, "moves": moved})
            log.info("search round %d: %d moves kept, loss %.4f (start %.4f), %d of %d evaluations",
                     len(history) - 1, moved, loss, history[0]["loss"], spent, evaluations)
            if not moved:
                break
    finally:
        t.restore()
    took, searched = time.perf_counter() - began, spent - len(start["probe"]["candidates"])
    log.info("search: %d evaluations in %.1f s (%.0f ms each)", searched, took, 1e3 * took / max(1, searched))
    allocation = {**start, "method": "search",
                  "ranks": [{**r, "rank": ranks[Slot(r["layer"], r["kind"], r["group"])]} for r in start["ranks"]]}
    allocation["search"] = {"start": start["selected"], "start_loss": history[0]["loss"],
                            "loss": loss, "ppl": math.exp(loss), "evaluations": spent,
                            "budget": evaluations, "rounds": history,
                            "windows": int(len(windows)), "seqlen": int(windows.shape[1])}
    return allocation


def _searcher(name: str, evaluations: int):
    def search(model, svds, stats, kept_ratio, group_size, multiple, windows, key_weight) -> dict:
        return {**search_ranks(model, svds, stats, kept_ratio, group_size, multiple, windows, evaluations),
                "method": name}
    return search


# The search budget is part of the allocator's name, so of every tag made from it (ranks file,
# checkpoint, run): `search-e800` spends 800 evaluations, `search-w8` reads 8 held-out windows of
# WINDOW_TOKENS, `search-e800-w8` both; `search` is the defaults' one name.
VARIANT = re.compile(r"search(?:-e([1-9][0-9]*))?(?:-w([1-9][0-9]*))?")


def search_variant(name: str) -> Allocator | None:
    """The searching allocator of a budget named `search-e<evaluations>-w<windows>` (either part
    may go); None for a name of another form. A default spelled out is refused (one name each)."""
    m = VARIANT.fullmatch(name)
    if m is None:
        return None
    evaluations, windows = int(m[1] or EVALUATIONS), int(m[2] or WINDOWS)
    if (m[1] and evaluations == EVALUATIONS) or (m[2] and windows == WINDOWS):
        raise ValueError(f"rank method {name!r} spells out a default ({EVALUATIONS} evaluations, {WINDOWS} "
                         f"windows): name it without that part ('search' for both)")
    return Allocator("all", probe=_searcher(name, evaluations), held_out=True, windows=windows)


register_allocator("search", search_variant("search"))
register_variants("search", search_variant)
