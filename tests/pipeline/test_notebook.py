"""The results notebook executes top to bottom against the committed results/ and shows them."""
from pathlib import Path

import nbformat
import pandas as pd
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_results_notebook_executes_and_shows_the_committed_numbers():
    nb = nbformat.read(ROOT / "notebooks" / "results.ipynb", as_version=4)
    NotebookClient(nb, timeout=None, kernel_name="python3",   # raises on any cell's error
                   resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    shown = "".join(str(o.get("data", {}).get("text/plain", "")) + str(o.get("text", ""))
                    for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    # the pivot tables print the committed perplexities (pandas shows 6 decimals)
    base = pd.read_csv(ROOT / "results" / "tables" / "baseline.csv")
    for ppl in base["ppl"]:
        assert f"{ppl:.6f}" in shown, (ppl, shown[:2000])
    for fig in (ROOT / "results" / "figures").glob("*.png"):
        assert fig.name in shown
