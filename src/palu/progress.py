"""Progress of long loops, as every library function's `progress=` argument asks:

- True: a tqdm bar (interactive use);
- "lines": a line every ~10% with the elapsed time and an estimate of what is left, through the
  `palu` logger where logging is configured for it, else on stderr (a notebook or a batch log
  without bars that still shows that a 10-minute evaluation is moving);
- False: the same lines through the `palu` logger only, so a script that configures no logging
  prints nothing (the pipeline configures it: under Snakemake each step logs its lines).
"""
from __future__ import annotations

import logging
import sys
import time
from typing import Iterable, Iterator, TypeVar

try:      # widget bars in a notebook need ipywidgets; without it tqdm.auto warns on import
    import ipywidgets  # noqa: F401
    from tqdm.auto import tqdm
except ImportError:
    from tqdm import tqdm

T = TypeVar("T")
log = logging.getLogger("palu")


MODES = (True, False, "lines")


def steps(items: Iterable[T], desc: str, unit: str, progress: bool | str = True,
          total: int | None = None, lines: int = 10) -> Iterator[T]:
    """Iterate `items`, reporting as a bar (`progress` True) or as about `lines` lines."""
    if progress not in MODES:
        raise ValueError(f"progress={progress!r} is not one of True (a bar), 'lines' (a line every "
                         "~10%, on stderr unless logging shows the palu logger) or False (log lines only)")
    if progress is True:
        yield from tqdm(items, desc=desc, unit=unit, total=total, leave=False)
        return
    say = _stderr if progress == "lines" and not _logging_shows() else log.info
    if total is None:
        total = len(items) if hasattr(items, "__len__") else None
    every = max(1, (total or 10) // lines)
    start = time.perf_counter()
    for i, item in enumerate(items, 1):
        yield item
        if i % every == 0 or i == total:
            elapsed = time.perf_counter() - start
            eta = f", ~{elapsed / i * (total - i):.0f} s left" if total else ""
            say("%s: %d/%s %s (%.0f s%s)", desc, i, total if total else "?", unit, elapsed, eta)


def _logging_shows() -> bool:
    """Whether an INFO line of the palu logger reaches a handler (the root's or its own)."""
    return log.isEnabledFor(logging.INFO) and log.hasHandlers()


def _stderr(fmt: str, *args) -> None:
    print(fmt % args, file=sys.stderr, flush=True)
