"""Tables (CSV + Markdown) and figures from result files."""
from __future__ import annotations

from pathlib import Path

from palu.artifacts import write_text


def write_frame(frame, prefix: str | Path, markdown: str):
    """`<prefix>.csv` (every column) and `<prefix>.md` (the readable table), each atomically."""
    write_text(f"{prefix}.csv", frame.to_csv(index=False))
    write_text(f"{prefix}.md", markdown)
    return frame
