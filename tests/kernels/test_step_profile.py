"""The step profile (palu_bench.step_profile) separates one decode step from the prefill by
differencing two profiled runs: its arithmetic on known tables, and its refusals."""
import pytest

from palu_bench.step_profile import NotAStepTime, overrides, prefill_rows, step_rows, step_times


def test_one_step_is_the_difference_of_the_two_runs_over_the_steps():
    # name -> (calls, self device us, self host us); kernels have device time and no host time
    short = {"gemm": (10, 100.0, 0.0), "aten::mm": (10, 0.0, 50.0), "cudaLaunchKernel": (20, 0.0, 40.0),
             "prefill_only": (1, 500.0, 0.0)}
    long = {"gemm": (50, 500.0, 0.0), "aten::mm": (50, 0.0, 250.0), "cudaLaunchKernel": (100, 0.0, 200.0),
            "prefill_only": (1, 500.0, 0.0), "decode_kernel": (8, 80.0, 0.0)}
    s = step_rows(short, long, steps=4, device="cuda", top=5)
    assert s["kernel_us"] == pytest.approx(120.0)             # (500 - 100 + 80) / 4
    assert s["kernel_calls"] == pytest.approx(12.0)           # (40 + 8) / 4 (prefill_only: 0 a step)
    assert s["kernel_launches"] == pytest.approx(20.0) and s["aten_calls"] == pytest.approx(10.0)
    assert [r["name"] for r in s["top_kernels"]][:2] == ["gemm", "decode_kernel"]
    assert s["graph_kernels_seen"]
    assert prefill_rows(short, 5)["kernel_us"] == pytest.approx(600.0)


def test_a_replayed_graph_whose_kernels_were_not_seen_says_so():
    short = {"cudaGraphLaunch": (1, 0.0, 5.0)}
    long = {"cudaGraphLaunch": (5, 0.0, 25.0)}
    s = step_rows(short, long, steps=4, device="cuda", top=5)
    assert s["graph_launches"] == pytest.approx(1.0) and s["top_kernels"] == []
    assert s["graph_kernels_seen"] is False


@pytest.mark.parametrize("items, said", [
    (["methods=[fp16,nope]", "model=m", "text=t"], "nope"),
    (["model=m"], "text= is required"),
    (["model=m", "text=t", "steps=0"], "steps=0"),
    (["model=m", "text=t", "batchsize=4"], "batchsize"),
])
def test_bad_arguments_are_refused_by_name(items, said):
    with pytest.raises(SystemExit, match=said):
        overrides(items)


def test_step_times_separate_the_prefill_the_captured_first_step_and_a_replay():
    """Answers of 1, 2 and 2 + steps tokens (fastest of the repeats): the first step's eager run
    and capture fall in 2 - 1, never into the per-step time."""
    walls = {1: [0.70, 0.60], 2: [0.75, 0.70], 10: [0.78, 0.74]}
    t = step_times(walls, steps=8)
    assert t["prefill_s"] == pytest.approx(0.60) and t["first_step_s"] == pytest.approx(0.10)
    assert t["step_ms"] == pytest.approx(5.0)                 # (0.74 - 0.70) / 8


def test_a_step_time_that_cannot_be_right_is_an_error():
    # session 42's Palu row: the 1-token run held a capture the longer one did not
    with pytest.raises(NotAStepTime, match="-"):
        step_times({1: [4.03], 2: [4.0], 10: [3.30]}, steps=8)
