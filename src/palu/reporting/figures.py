"""Figures drawn from pipeline outputs."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from ..io import atomic_path, read_json  # noqa: E402


def rank_allocation_figure(allocation: dict, out: str | Path, title: str = "") -> None:
    """Heatmap of the kept-rank fraction per layer for K and V (the paper's Fig. 5 style)."""
    layers = 1 + max(r["layer"] for r in allocation["ranks"])
    frac = np.zeros((2, layers))
    full = np.zeros((2, layers))
    for r in allocation["ranks"]:
        row = 0 if r["kind"] == "k" else 1
        frac[row, r["layer"]] += r["rank"]
        full[row, r["layer"]] += r["full"]
    frac /= full
    fig, ax = plt.subplots(figsize=(max(6, layers * 0.32), 2.4))
    im = ax.imshow(frac, aspect="auto", cmap="viridis", vmin=0, vmax=1)
    ax.set_yticks([0, 1], ["K", "V"])
    ax.set_xticks(range(layers), [str(i) for i in range(layers)], fontsize=7)
    ax.set_xlabel("layer")
    for (i, j), v in np.ndenumerate(frac):
        ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=5.5,
                color="white" if v < 0.6 else "black")
    fig.colorbar(im, ax=ax, label="kept rank fraction")
    ax.set_title(title or (f"{allocation['method']} ranks, kept ratio "
                           f"{allocation['kept_ratio_realised']:.3f}, group size {allocation['group_size']}"))
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, dpi=150, format="png")
    plt.close(fig)


def rank_allocation_from_file(ranks_json: str | Path, out: str | Path) -> None:
    rank_allocation_figure(read_json(ranks_json), out)
