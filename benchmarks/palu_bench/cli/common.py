"""What the benchmark entry points share: their Hydra config tree (palu_bench/conf) and logger."""
from __future__ import annotations

import logging
from pathlib import Path

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")
log = logging.getLogger("palu_bench")
