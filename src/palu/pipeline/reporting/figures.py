"""Figures drawn from pipeline outputs."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from palu.artifacts import atomic_path, read_json  # noqa: E402


def _kept_fraction(allocation: dict) -> np.ndarray:
    """(2, layers): kept rank over full rank of the K and V blocks of every layer."""
    layers = 1 + max(r["layer"] for r in allocation["ranks"])
    frac, full = np.zeros((2, layers)), np.zeros((2, layers))
    for r in allocation["ranks"]:
        row = 0 if r["kind"] == "k" else 1
        frac[row, r["layer"]] += r["rank"]
        full[row, r["layer"]] += r["full"]
    return frac / full


def _method_label(allocation: dict) -> str:
    label = allocation["method"]
    if "search" in allocation:              # search starts from probe_select's choice and moves ranks
        s = allocation["search"]
        label += f" (from {s['start']}, {sum(r['moves'] for r in s['rounds'])} moves)"
    elif allocation.get("selected"):        # probe_select names the allocator it chose
        label += f" (chose {allocation['selected']})"
    elif "key_weight" in allocation:
        label += f" (key weight {allocation['key_weight']:g})"
    keys = sum(r["rank"] for r in allocation["ranks"] if r["kind"] == "k")
    return f"{label}: key share {keys / allocation['latent_size']:.2f}"


def rank_allocation_figure(allocations: list[dict], out: str | Path) -> None:
    """Kept-rank fraction per layer for K and V (the paper's Fig. 5 style), one panel per
    allocation, so allocators at the same budget read side by side."""
    if not allocations:
        raise ValueError("rank allocation figure: no allocations")
    budgets = {(a["kept_ratio_target"], a["group_size"]) for a in allocations}
    if len(budgets) != 1:
        raise ValueError(f"rank allocation figure compares one kept ratio and group size; got {sorted(budgets)}")
    fracs = [_kept_fraction(a) for a in allocations]
    layers = fracs[0].shape[1]
    fig, axes = plt.subplots(len(allocations), 1, squeeze=False, layout="constrained",
                             figsize=(max(6, layers * 0.32), 0.6 + 2.0 * len(allocations)))
    for ax, a, frac in zip(axes[:, 0], allocations, fracs):
        im = ax.imshow(frac, aspect="auto", cmap="viridis", vmin=0, vmax=1)
        ax.set_yticks([0, 1], ["K", "V"])
        ax.set_xticks(range(layers), [str(i) for i in range(layers)], fontsize=7)
        for (i, j), v in np.ndenumerate(frac):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=5.5,
                    color="white" if v < 0.6 else "black")
        ax.set_title(_method_label(a), fontsize=9)
    axes[-1, 0].set_xlabel("layer")
    (kept, group), = budgets
    fig.suptitle(f"kept rank fraction per layer, kept ratio {kept:g}, group size {group}", fontsize=10)
    fig.colorbar(im, ax=axes[:, 0].tolist(), label="kept rank fraction", fraction=0.03)
    with atomic_path(out) as tmp:
        fig.savefig(tmp, dpi=150, format="png")
    plt.close(fig)


def rank_allocation_figures(ranks_jsons: list[str | Path], out: str | Path) -> None:
    rank_allocation_figure([read_json(p) for p in ranks_jsons], out)


def _save(fig, out) -> None:
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, dpi=150, format="png")
    plt.close(fig)


FAMILY_STYLE = {   # marker, colour per method family
    "fp16": ("*", "black"), "palu": ("o", "tab:blue"), "palu+hadamard": ("D", "tab:cyan"),
    "palu+random_orthogonal": ("d", "tab:purple"), "atom": ("s", "tab:red"),
    "kivi": ("^", "tab:orange"), "turboquant": ("v", "tab:green"), "kvquant": ("P", "tab:brown"),
}


def pareto_front(bits: np.ndarray, ppl: np.ndarray) -> np.ndarray:
    """Indices of the points no other point beats on both bits and perplexity, by bits."""
    order = np.lexsort((ppl, bits))
    front, best = [], np.inf
    for i in order:
        if ppl[i] < best:
            front.append(i)
            best = ppl[i]
    return np.array(front, dtype=int)


def ppl_vs_bytes_figure(table_csv: str | Path, out: str | Path, zoom: float = 2.0) -> None:
    """Perplexity against the effective bits per K/V element each cache really stored (metadata
    and exact tokens included), the Pareto front drawn, per corpus two panels: every method on a
    logarithmic perplexity axis (a collapsed method at its value, not clipped), and the methods
    within `zoom` x FP16's perplexity on a linear axis, each labelled without overlap."""
    import pandas as pd
    frame = pd.read_csv(table_csv)
    if frame["effective_bits"].isna().any():
        missing = frame.loc[frame["effective_bits"].isna(), "method"].tolist()
        raise ValueError(f"{table_csv}: rows without measured bytes: {missing}")
    corpora = sorted(frame["corpus"].unique())
    fig, axes = plt.subplots(len(corpora), 2, figsize=(14, 5.8 * len(corpora)), squeeze=False,
                             gridspec_kw={"width_ratios": [1, 1.35]})
    for (whole, near), corpus in zip(axes, corpora):
        part = frame[frame["corpus"] == corpus].reset_index(drop=True)
        bits, ppl = part["effective_bits"].to_numpy(float), part["ppl"].to_numpy(float)
        fp = part.loc[part["method"] == "fp16", "ppl"]
        ref = fp.iloc[0] if len(fp) else float(np.min(ppl))
        labels = [_short(r) for _, r in part.iterrows()]
        inside = ppl <= zoom * ref
        front = pareto_front(bits, ppl)
        for ax in (whole, near):
            seen = set()
            for k, row in part.iterrows():
                if ax is near and not inside[k]:
                    continue
                fam = _family_label(row)
                marker, colour = FAMILY_STYLE.get(fam, ("x", "gray"))
                ax.scatter(bits[k], ppl[k], marker=marker, color=colour, s=46, zorder=3,
                           label=None if fam in seen else fam)
                seen.add(fam)
            ax.step(bits[front], ppl[front], where="post", color="gray", lw=1, ls="--",
                    label="Pareto front", zorder=2)
            ax.axhline(ref, color="black", lw=0.6, ls=":")
            ax.set_xscale("log", base=2)
            ticks = [t for t in (1, 1.5, 2, 3, 4, 6, 8, 16) if bits.min() * 0.9 <= t <= bits.max() * 1.1]
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            ax.grid(alpha=0.3, which="major")
            ax.set_xlabel("effective bits per K/V element (measured bytes x 8 / elements, log scale)")
        whole.set_yscale("log")
        yticks = [t for t in (20, 30, 50, 100, 200, 500, 1000, 2000) if ppl.min() * 0.8 <= t <= ppl.max() * 1.25]
        whole.set_yticks(yticks, [f"{t:g}" for t in yticks])
        whole.yaxis.set_minor_formatter(plt.NullFormatter())
        whole.set_ylabel("perplexity (log scale)")
        whole.set_title(f"{corpus}: every method")
        whole.axhspan(ref * 0.95, zoom * ref, color="0.9", zorder=0, label=f"right panel (≤ {zoom:g}x FP16)")
        whole.legend(fontsize=7, loc="upper right")
        collapsed = np.flatnonzero(~inside)      # the collapsed ones, named where they are
        _place_labels(whole, bits[collapsed], ppl[collapsed], [f"{labels[k]} ({ppl[k]:.0f})" for k in collapsed],
                      others=(bits, ppl))
        near.set_ylim(ref * 0.95, zoom * ref)
        near.set_ylabel("perplexity")
        near.set_title(f"{corpus}, {int(part['seqlen'].iloc[0])}-token windows: within {zoom:g}x FP16")
        idx = np.flatnonzero(inside)
        _place_labels(near, bits[idx], ppl[idx], [labels[k] for k in idx])
    _save(fig, out)


def _place_labels(ax, xs, ys, texts, fontsize: float = 7, others=None) -> None:
    """Each text near its point at the first of a few offsets (right, above, below, left, then
    further out) where it overlaps no label already placed and no point (`others`: more points,
    unlabelled, to keep clear of); a leader line joins a label set away from its point."""
    from matplotlib.transforms import Bbox
    fig = ax.figure
    fig.canvas.draw()
    renderer, pt = fig.canvas.get_renderer(), 72.0 / fig.dpi       # display pixels -> points
    centres = ax.transData.transform(np.column_stack([xs, ys]))
    marks = centres if others is None else ax.transData.transform(np.column_stack(others))
    obstacles = [Bbox.from_bounds(x - 5, y - 5, 10, 10) for x, y in marks]
    steps = [(6, -4), (6, 6), (6, -14), (None, -4), (6, 16), (6, -24), (None, 8), (None, -16),
             (6, 26), (6, -34), (18, 30), (18, -40), (6, 38), (6, -46)]
    for i in np.argsort(ys, kind="stable"):
        probe = ax.annotate(texts[i], (xs[i], ys[i]), fontsize=fontsize)
        w, h = [v for v in probe.get_window_extent(renderer).size]
        probe.remove()
        for dx, dy in steps:
            dx = -6 - w * pt if dx is None else dx
            box = Bbox.from_bounds(centres[i][0] + dx / pt, centres[i][1] + dy / pt, w, h)
            if not any(box.overlaps(o) for o in obstacles):
                break
        obstacles.append(box)
        far = abs(dy) > 8 or dx > 6
        ax.annotate(texts[i], (xs[i], ys[i]), xytext=(dx, dy), textcoords="offset points",
                    fontsize=fontsize, zorder=4,
                    arrowprops=dict(arrowstyle="-", lw=0.4, color="0.5", shrinkA=0, shrinkB=3) if far else None)


def _family_label(row) -> str:
    fam = row.get("family") if isinstance(row.get("family"), str) else None
    if fam in (None, "-"):
        fam = "fp16" if row["method"] == "fp16" else "palu"
    if fam == "palu" and row.get("rotation", "none") not in ("none", None):
        fam = f"palu+{row['rotation']}"
    return fam


def _short(row) -> str:
    if row["method"] == "fp16":
        return "fp16"
    fam = _family_label(row)
    bits = int(row["kv_bits"])
    if fam.startswith("palu"):
        rot = "+H" if "hadamard" in fam else ("+R" if "random" in fam else "")
        return f"{int(round((1 - row['kept_ratio_target']) * 100))}%/{bits}b{rot}"
    if fam == "kvquant" and "-uniform-" in row["method"]:     # the plain k-means ablation
        return f"{fam}-{bits} (k-means)"
    return f"{fam}-{bits}"


def latent_outliers_figure(model_dir: str, checkpoints: list[str], corpus: str, out: str | Path,
                           layer: int | None = None, tokens: int = 2048) -> None:
    """Per-channel magnitude of one layer's key latents under each checkpoint's rotation (the
    paper's Fig. 4): the largest |latent| per channel and its 99th percentile over the tokens of
    `corpus`. A rotation spreads outlier channels, so the per-token range a quantiser must cover
    shrinks."""
    import copy

    import torch

    from palu.data.corpora import load_corpus
    from palu.data.windows import tokenize
    from palu.decompose.checkpoint import load_compressed
    from palu.models.loading import load_model
    base, tok = load_model(model_dir)
    ids = tokenize(tok, load_corpus(corpus).evaluation_text)[:tokens][None]
    layer = base.config.num_hidden_layers // 2 if layer is None else layer
    fig, axes = plt.subplots(len(checkpoints), 1, figsize=(9, 2.4 * len(checkpoints)), squeeze=False)
    for ax, path in zip(axes[:, 0], checkpoints):
        model = copy.deepcopy(base)
        manifest = load_compressed(model, path)
        attn = [m for m in model.modules() if getattr(m, "stores_latents", False)][layer]
        seen = {}

        def keep_input(module, args, kwargs):
            seen["x"] = kwargs.get("hidden_states", args[0] if args else None)

        handle = attn.register_forward_pre_hook(keep_input, with_kwargs=True)
        with torch.no_grad():
            model(ids, use_cache=False)
        handle.remove()
        raw = (seen["x"][0].float() @ attn.A_k.float().T)[:, :attn.ranks_k[0]]       # group 0
        h = raw.abs()
        peak, p99 = h.amax(0).numpy(), torch.quantile(h, 0.99, dim=0).numpy()
        spread = ((raw.amax(1) - raw.amin(1)) / raw.std(1)).mean().item()   # what 1 scale covers
        x = np.arange(len(peak))
        ax.bar(x, peak, color="tab:red", alpha=0.6, label="max |latent|")
        ax.bar(x, p99, color="tab:blue", alpha=0.8, label="99th percentile")
        rotation = manifest.get("summary", {}).get("rotation", "none")
        ax.set_title(f"layer {layer} key latents, rotation {rotation}: largest / median channel "
                     f"99th percentile {p99.max() / np.median(p99):.2f}x, mean per-token range / std "
                     f"{spread:.1f}", fontsize=8)
        ax.set_xlabel("latent channel (group 0)")
        ax.set_ylabel("|latent|")
        ax.legend(fontsize=7)
    _save(fig, out)
