"""The throughput table names the decode path each row was timed on (its switches)."""
import json

from palu_bench.report.throughput import throughput_frame, throughput_markdown


def _run(tmp_path, name, switches, **extra):
    rows = [{"path": "palu", "method": "fp16", "batch": b, "prompts": b, "seconds": 1.0, "prompts_per_s": b,
             "peak_gib": 1.0, "kv_bytes_per_prompt": 2**20, **({"switches": switches} if switches is not None else {})}
            for b in (1, 4)]
    data = {"config": {"length": 4032, "new_tokens": 64, "dtype": "float16", "warmup": True, "model": "m"},
            "env": {"torch": "2", "transformers": "5", "gpu": "GPU"}, "rows": rows, "skipped": [], **extra}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_each_rows_decode_switches_are_in_the_table(tmp_path):
    paths = [_run(tmp_path, "plain", None), _run(tmp_path, "empty", {}),
             _run(tmp_path, "switched", {"PALU_STATIC_DECODE": "all", "PALU_DENSE_DECODE": "1"})]
    md = throughput_markdown(*throughput_frame(paths))
    rows = {line.split(" | ")[0].strip("| "): line for line in md.splitlines() if line.startswith("| ")}
    assert rows["switched"].endswith("| PALU_DENSE_DECODE=1 PALU_STATIC_DECODE=all |")
    assert rows["plain"].endswith("| — |") and rows["empty"].endswith("| — |")


def test_a_run_of_random_weights_says_so(tmp_path):
    paths = [_run(tmp_path, "real", None), _run(tmp_path, "shapes", None, weights="random")]
    md = throughput_markdown(*throughput_frame(paths))
    runs = {line[3:].split("`")[0]: line for line in md.splitlines() if line.startswith("- `")}
    assert "**random weights**" in runs["shapes"] and "random" not in runs["real"]


def test_the_figure_wraps_many_runs_into_rows(tmp_path):
    from PIL import Image
    from palu_bench.report.throughput import throughput_figure
    paths = [_run(tmp_path, f"run{i}", None) for i in range(7)]
    out = tmp_path / "throughput.png"
    throughput_figure(throughput_frame(paths)[0], str(out))
    width, height = Image.open(out).size
    assert width < 2 * height, (width, height)      # 3 columns x 3 rows, not 7 panels in a row
