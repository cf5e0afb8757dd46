"""Progress of long loops: a tqdm bar when `progress` is on, else a log line every ~10% (with
`progress=false`, as under Snakemake, a long step would otherwise print nothing for minutes)."""
from __future__ import annotations

import logging
import time
from typing import Iterable, Iterator, TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")
log = logging.getLogger("palu")


def steps(items: Iterable[T], desc: str, unit: str, progress: bool = True,
          total: int | None = None, lines: int = 10) -> Iterator[T]:
    """Iterate `items`, reporting as a bar (`progress`) or as about `lines` log lines."""
    if progress:
        yield from tqdm(items, desc=desc, unit=unit, total=total, leave=False)
        return
    if total is None:
        total = len(items) if hasattr(items, "__len__") else None
    every = max(1, (total or 10) // lines)
    start = time.perf_counter()
    for i, item in enumerate(items, 1):
        yield item
        if i % every == 0 or i == total:
            elapsed = time.perf_counter() - start
            eta = f", ~{elapsed / i * (total - i):.0f} s left" if total else ""
            log.info("%s: %d/%s %s (%.0f s%s)", desc, i, total if total else "?", unit, elapsed, eta)
