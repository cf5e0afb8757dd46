"""The results notebook executes top to bottom against the committed results/ and shows every
committed table and figure, with intervals."""
from pathlib import Path

import nbformat
import pandas as pd
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_results_notebook_shows_every_table_and_figure_with_intervals():
    nb = nbformat.read(ROOT / "notebooks" / "results.ipynb", as_version=4)
    NotebookClient(nb, timeout=None, kernel_name="python3",   # raises on any cell's error
                   resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    shown = "".join(str(o.get("data", {}).get("text/plain", "")) + str(o.get("text", ""))
                    for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    # a section per committed table and figure (a missing one raises in the notebook)
    # ... and of the second model's grid (results/gemma3-270m/)
    for folder in ("results", "results/gemma3-270m", "results/long-pilot", "results/rank-search",
                   "results/gemma3-270m-rank-search", "results/h200",
                   "results/h200-zeroshot", "results/h200-long", "results/gemma3-270m-search-budget",
                   "results/h200-rank-search"):
        for table in sorted((ROOT / folder / "tables").glob("*.csv")):
            assert f"{folder}/tables/{table.name}" in shown, table
        for fig in sorted((ROOT / folder / "figures").glob("*.png")):
            assert f"{folder}/figures/{fig.name}" in shown, fig
    for made in ("calibration_domain.md", "calibration_domain.png"):   # the three calibration grids
        assert f"results/calibration-domain/{made}" in shown, made
    # perplexities print with their intervals, compressed rows with the paired difference
    base = pd.read_csv(ROOT / "results" / "tables" / "baseline.csv")
    for r in base.itertuples():
        assert f"{r.ppl:.2f} [{r.ppl_lo:.2f}, {r.ppl_hi:.2f}]" in shown
    bits = pd.read_csv(ROOT / "results" / "tables" / "latent_bits.csv")
    r = bits[bits.method != "fp16"].iloc[0]
    assert f"Δ{r.diff_vs_fp16:+.2f} [{r.diff_lo:+.2f}, {r.diff_hi:+.2f}]" in shown
    assert "not built" not in shown
