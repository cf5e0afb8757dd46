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
    # 5 prompts (of 5 + 4 tokens) ran out: 2, at most 18 tokens a batch from then on
    assert fake.sizes == [5, 2, 2, 1]


class _TokenBudget(_Tracker):
    """Fails when a batch's padded prompt + answer tokens exceed `budget` (memory ~ linear in them)."""
    def __init__(self, budget):
        super().__init__(fits=None, error=torch.OutOfMemoryError("oom"))
        self.budget, self.batches = budget, []

    def __call__(self, model, tokenizer, method, prompts, new):
        self.sizes.append(len(prompts))
        if len(prompts) * (max(map(len, prompts)) + new) > self.budget:
            raise self.error
        self.batches.append([len(p) for p in prompts])
        return [(f"answer{len(p)}", None) for p in prompts]


def test_auto_batches_grow_back_as_prompts_shorten(monkeypatch):
    """A batch halved to one 32K-token prompt stayed one prompt for the 4K ones after it (session
    53: every RULER-style answer of a job went one at a time); now it holds as many tokens."""
    fake = _TokenBudget(budget=50)
    monkeypatch.setattr(generation, "_generate", fake)
    monkeypatch.setattr(generation, "resolve_batch_size", lambda size, model: 8)
    prompts = [[1] * 40] * 2 + [[1] * 10] * 7
    out = generation.answer_batches(None, None, None, prompts, 4, batch_size="auto")
    assert [a for a, _ in out] == [f"answer{len(p)}" for p in prompts]
    # 8 x 44 -> 4 x 44 -> 2 x 44 out of memory; one 40-token prompt at a time (44 tokens), then
    # three 10-token prompts a batch (3 x 14 = 42 <= 44)
    assert fake.batches == [[40], [40], [10, 10, 10], [10, 10, 10], [10]]
    fixed = _TokenBudget(budget=50)
    monkeypatch.setattr(generation, "_generate", fixed)
    monkeypatch.setattr(generation, "resolve_batch_size", lambda size, model: size)
    generation.answer_batches(None, None, None, [[1] * 10] * 4, 4, batch_size=3)
    assert fixed.batches == [[10, 10, 10], [10]]    # a fixed size is never resized


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


def test_a_step_with_gpu_shares_takes_that_many_slots_and_that_much_memory_locally_only():
    """Qwen2.5-1.5B's Fisher step ran out of a 1/5 share (session 53): `gpu_shares: 2` gives its
    jobs 2 of the run's 5 slots and 2/5 of its memory; never more than the run has; on a cluster
    (no `shared_by`) one GPU of its own as before."""
    from palu.pipeline.jobs import gpu_share, scheduler_resources
    grid = {"threads": 1, "fisher": {"gpu_shares": 2}, "longcontext": {"gpu_shares": 9}}
    assert scheduler_resources(grid, "cuda", "fisher", shared_by=5)["gpu"] == 2
    assert scheduler_resources(grid, "cuda", "evaluate", shared_by=5)["gpu"] == 1
    assert scheduler_resources(grid, "cuda", "longcontext", shared_by=5)["gpu"] == 5   # at most N
    assert scheduler_resources(grid, "cuda", "fisher")["gpu"] == 1                     # a cluster
    assert "gpu_shares" not in scheduler_resources(grid, "cuda", "fisher", shared_by=5)
    assert "gpu" not in scheduler_resources(grid, "cpu", "fisher", shared_by=5)
    assert gpu_share(5, "0.7", 2) == "0.2800"
    assert gpu_share(5, "0.7") == "0.1400"
    assert gpu_share(2, None, 9) == "0.9500"                                           # at most N
    for bad in (0, True, "2"):
        with pytest.raises(ValueError, match="gpu_shares"):
            gpu_share(5, "0.7", bad)
    with pytest.raises(ValueError, match="gpu_shares"):
        scheduler_resources({"fisher": {"gpu_shares": 0}}, "cuda", "fisher", shared_by=5)


def test_the_workflow_puts_each_steps_share_before_its_command(tmp_path):
    """Planned for real (`snakemake -n` on a cuda grid, 5 jobs sharing the GPU, 0.7 of it): the
    Fisher job asks for 2 GPU slots and runs under PALU_GPU_SHARE=0.2800, an evaluation under
    0.1400; the CPU-only prepare step gets no cap."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    grid = tmp_path / "grid.yaml"
    grid.write_text(f"work: {tmp_path}/work\nresults: {tmp_path}/results\ndevice: cuda\ntracking: disabled\n"
                    "resources: {threads: 1, fisher: {gpu_shares: 2}}\n"
                    "methods: []\nrank_allocation: {kept_ratios: [0.5], methods: [fisher], group_sizes: [1]}\n")
    out = subprocess.run([sys.executable, "-m", "snakemake", "-n", "-p", "--cores", "4", "--resources", "gpu=5",
                          "--configfile", str(root / "conf/grid/small.yaml"), str(grid)], cwd=root, capture_output=True, text=True,
                         env={**os.environ, "PALU_GPU_MEMORY": "0.7"}, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    jobs = out.stdout.split("\nrule ")
    fisher = next(j for j in jobs if j.startswith("fisher:"))
    evaluate = next(j for j in jobs if j.startswith("evaluate:"))
    prepare = next(j for j in jobs if j.startswith("prepare_model:"))
    assert re.search(r"\bgpu=2\b", fisher) and "PALU_GPU_SHARE=0.2800 exec" in fisher
    assert re.search(r"\bgpu=1\b", evaluate) and "PALU_GPU_SHARE=0.1400 exec" in evaluate
    assert "PALU_GPU_SHARE" not in prepare
