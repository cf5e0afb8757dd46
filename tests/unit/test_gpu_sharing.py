"""Jobs sharing one GPU: a job halves its batch on any form the GPU's out-of-memory takes, and
holds to its share of the memory when the workflow gives it one."""
import pytest
import torch

from palu.eval import generation
from palu.pipeline.cli.common import limit_gpu_share


class _Tracker:
    """A stand-in for one batch's generation: fails with `error` above `fits` prompts."""
    def __init__(self, fits, error):
        self.fits, self.error, self.sizes = fits, error, []

    def __call__(self, model, tokenizer, method, prompts, new):
        self.sizes.append(len(prompts))
        if len(prompts) > self.fits:
            raise self.error
        return [(f"answer{len(p)}", None) for p in prompts]


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"),
                                   RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"),
                                   RuntimeError("CUDA error: out of memory")])
def test_auto_batches_halve_on_every_form_of_out_of_memory(monkeypatch, error):
    fake = _Tracker(fits=2, error=error)
    monkeypatch.setattr(generation, "_generate", fake)
    monkeypatch.setattr(generation, "resolve_batch_size", lambda size, model: 8)
    prompts = [[1] * n for n in (5, 4, 3, 2, 1)]
    out = generation.answer_batches(None, None, None, prompts, 4, batch_size="auto")
    assert [a for a, _ in out] == [f"answer{n}" for n in (5, 4, 3, 2, 1)]
    assert fake.sizes[:3] == [5, 4, 2]      # 8 (all 5 prompts) -> 4 -> 2, then batches of 2


def test_other_errors_and_fixed_batches_are_not_retried(monkeypatch):
    monkeypatch.setattr(generation, "resolve_batch_size", lambda size, model: 8)
    monkeypatch.setattr(generation, "_generate", _Tracker(fits=2, error=RuntimeError("shape mismatch")))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        generation.answer_batches(None, None, None, [[1]] * 4, 4, batch_size="auto")
    monkeypatch.setattr(generation, "_generate", _Tracker(fits=2, error=torch.OutOfMemoryError("oom")))
    with pytest.raises(torch.OutOfMemoryError):
        generation.answer_batches(None, None, None, [[1]] * 4, 4, batch_size=8)


def test_gpu_share_applies_to_gpu_jobs_only_and_names_a_bad_value():
    assert limit_gpu_share("cpu", "0.25") is None
    assert limit_gpu_share("cuda", "") is None
    for bad in ("0", "1.5", "half"):
        with pytest.raises(ValueError, match=f"PALU_GPU_SHARE='{bad}'"):
            limit_gpu_share("cuda", bad)


def test_a_run_divides_its_part_of_the_gpu_among_its_jobs_and_two_runs_can_divide_the_gpu():
    from palu.pipeline.jobs import gpu_share
    assert gpu_share(1) is None                        # one job: the whole GPU, no cap
    assert gpu_share(5) == "0.1900"                    # 0.95 / 5, as before
    assert gpu_share(4, "0.6") == "0.1500"             # this run's part of the GPU over its jobs
    assert gpu_share(1, "0.35") == "0.3500"            # one job beside another run: capped too
    for bad in ("0", "1.5", "half", "-0.2"):
        with pytest.raises(ValueError, match=f"PALU_GPU_MEMORY='{bad}'"):
            gpu_share(3, bad)
