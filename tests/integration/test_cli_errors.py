"""Bad input through the entry points: a clear message, a non-zero exit, and no output file."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, TEST_WORK

pytestmark = pytest.mark.slow


def _run(step, *overrides, tmp_path):
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", f"palu.pipeline.cli.{step}", f"paths.work={TEST_WORK}", "tracking=disabled",
           f"paths.results={tmp_path}", f"out={out}", "progress=false", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    return proc, out


# (step, overrides, the message it must print)
BAD_INPUTS = [
    ("evaluate", ["model=no-such-model"], "Could not find 'model/no-such-model'"),
    ("evaluate", ["data.seqln=128"], "seqln"),
    ("evaluate", ["data.seqlen=0"], "data.seqlen=0 must be a positive integer"),
    ("evaluate", ["data.seqlen=100000"], "seqlen=100000 exceeds the model's maximum of 8192"),
    ("evaluate", ["data=wikitext2"], "corpus 'wikitext2' is not available"),
    ("evaluate", ["data=ptb", "data.path=/nonexistent"], "ptb.train.txt does not exist"),
    ("evaluate", ["model.id=/nonexistent/folder"], "neither a local folder"),
    ("ranks", ["palu.kept_ratio=1.5"], "palu.kept_ratio=1.5 must lie in (0, 1]"),
    ("ranks", ["palu.kept_ratio=0"], "palu.kept_ratio=0"),
    ("ranks", ["palu.group_size=2"], "group_size=2 does not divide the 3 KV heads"),
    ("evaluate", ["method=palu", "method.checkpoint=/nonexistent"], "is not a Palu checkpoint"),
    # the latent width's old key (issue 52 item 4): refused by its new name before Hydra's own message
    ("evaluate", ["method=palu", "method.checkpoint=x", "method.bits=4"],
     "method.bits: method=palu calls this field 'latent_bits' now"),
    # the KV-quantisation baselines (issue 16): bits, groups and windows that do not fit, an
    # outlier fraction out of range, an unknown rotation or method
    ("evaluate", ["method=atom", "method.bits=5"], "method.bits=5 is not one of [2, 3, 4, 8]"),
    ("evaluate", ["method=turboquant", "method.bits=8"], "method.bits=8 is not one of [2, 3, 4]"),
    ("evaluate", ["method=kivi", "method.group=48", "method.residual=96"],
     "group size 48 does not divide head_dim"),
    ("evaluate", ["method=kivi", "method.residual=100"], "method.residual=100 must be a non-negative multiple"),
    ("evaluate", ["method=atom", "method.group=24"], "group size 24 does not divide head_dim (64)"),
    ("fit", ["fitted=kvquant", "kvquant.outlier_fraction=0.5"], "outlier_fraction=0.5 is not in [0, 0.5)"),
    ("fit", ["fitted=kvquant", "kvquant.bits=1"], "kvquant bits=1 is not one of [2, 3, 4, 8]"),
    ("fit", ["kvquant.bits=3"], "this step fits a method's state: give fitted=<one of ['kivi_vscale', 'kvquant']>"),
    ("fit", ["fitted=kvquantt"], "fitted='kvquantt' is not one of ['kivi_vscale', 'kvquant']"),
    ("capture", ["fitted=kvquant", "kvquant.samples=0"], "kvquant.samples=0 must be a positive integer"),
    ("fit", ["fitted=kivi_vscale", "kivi_vscale.alpha=2"], "kivi_vscale alpha=2.0 is not in [0, 1]"),
    ("evaluate", ["method=kivi_vscale"], "method=kivi_vscale needs method.state"),
    ("evaluate", ["method=kvquant"], "method=kvquant needs method.state"),
    ("evaluate", ["method=kvquant", "method.state=/nonexistent"], "no KVQuant state"),
    ("decompose", ["palu.rotation=givens"], "palu.rotation='givens' is not one of"),
    ("evaluate", ["method=quarot"], "Could not find 'method/quarot'"),
    # the long-context suites (issue 17): a missing data folder, a context over the model's
    ("longcontext", ["longcontext.suite=longbench", "longcontext.longbench.dir=/nonexistent/lb"],
     "missing LongBench files in /nonexistent/lb: narrativeqa.jsonl"),
    ("longcontext", ["longcontext.suite=qasper", "longcontext.qasper.max_length=9000"],
     "prompts of up to 9000 tokens (with the answer) exceed the model's maximum context (8192"),
    # LoRA recovery (issue 21.4): no checkpoint, a missing one, zero steps
    ("recover", ["recovery.rank=8"], "recovery.checkpoint=<Palu checkpoint folder> is required"),
    ("recover", ["recovery.checkpoint=/nonexistent"], "is not a checkpoint folder"),
    ("recover", ["recovery.steps=0"], "recovery.steps=0 must be a positive integer"),
]


def _argv(case_dir, overrides):
    if "model.id=" in overrides[0]:
        overrides = [*overrides, "model.name=elsewhere"]  # else the prepared copy would be used
    return [f"paths.work={TEST_WORK}", "tracking=disabled", f"paths.results={case_dir}",
            f"out={case_dir / 'out.json'}", "progress=false", *overrides]


@pytest.fixture(scope="module")
def bad_input_runs(prepared_model, tmp_path_factory):
    """Every BAD_INPUTS case through its entry point's `main`, all in one subprocess
    (tests/integration/cli_runner.py), each with a results folder of its own."""
    root = tmp_path_factory.mktemp("bad-inputs")
    cases = []
    for i, (step, overrides, _) in enumerate(BAD_INPUTS):
        case_dir = root / f"case{i}"
        case_dir.mkdir()
        cases.append({"step": step, "argv": _argv(case_dir, overrides), "dir": str(case_dir)})
    (root / "cases.json").write_text(json.dumps(cases))
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("cli_runner.py")), str(root / "cases.json")],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("index", range(len(BAD_INPUTS)), ids=[f"{s}-{o[0]}" for s, o, _ in BAD_INPUTS])
def test_bad_input_fails_early_without_output(bad_input_runs, index):
    step, overrides, message = BAD_INPUTS[index]
    run = bad_input_runs[index]
    assert run["code"] != 0, (step, overrides)
    assert message in run["output"], run["output"][-2000:]
    assert run["left"] == [], run["left"]   # no output file, nothing else either


def test_a_bad_input_exits_non_zero_as_a_process(prepared_model, tmp_path):
    """The same refusal as a process of its own: the exit status a shell or Snakemake sees."""
    proc, out = _run("evaluate", "data.seqlen=0", tmp_path=tmp_path)
    assert proc.returncode != 0
    assert "data.seqlen=0 must be a positive integer" in proc.stderr + proc.stdout
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_mismatched_checkpoint_is_refused(prepared_model, tmp_path):
    """A checkpoint made from another model cannot be loaded onto SmolLM2."""
    import copy

    import torch

    import palu
    from tiny import tiny_llama
    model = tiny_llama()
    res = palu.compress(copy.deepcopy(model), torch.randint(0, 97, (2, 32)), kept_ratio=0.5,
                        progress=False, model_id="tiny-llama")
    ckpt = tmp_path / "ckpt"
    res.save(ckpt)
    proc, out = _run("evaluate", "method=palu", f"method.checkpoint={ckpt}", "data.max_tokens=256",
                     "data.seqlen=128", tmp_path=tmp_path)
    assert proc.returncode != 0
    assert "was made from 'tiny-llama'" in proc.stderr + proc.stdout
    assert not out.exists()


def test_an_unsupported_family_is_refused_by_every_step(tmp_path):
    """Issue 20.3: Gemma-3 (then unsupported) was refused by compress / ranks / calibrate but
    evaluated as a baseline with garbage; now each step refuses a family without an adapter
    (GPT-2 here), exiting non-zero with the supported families."""
    from tiny import save_tiny, tiny_gpt2, tiny_tokenizer
    folder = save_tiny(tiny_gpt2(), tiny_tokenizer(add_bos=True), tmp_path / "gpt2")
    results = tmp_path / "results"
    results.mkdir()
    for step in ("prepare", "evaluate", "calibrate", "generate"):
        proc, out = _run(step, f"model.id={folder}", "model.name=tiny-gpt2", tmp_path=results)
        assert proc.returncode != 0, step
        assert "'gpt2' is not supported; supported families: [" in proc.stderr + proc.stdout, step
        assert not out.exists() and list(results.iterdir()) == [], step


def test_a_checkpoint_is_evaluated_by_hand_with_its_folder_alone(tmp_path):
    """Issue 35: `evaluate method=palu method.checkpoint=<dir> method.latent_bits=4` needs no palu.*
    setting: the manifest says how the checkpoint was made (here J-LRD, group size 2, kept 0.7,
    where the palu.* defaults say M-LRD at 0.5; this used to fail after loading the model)."""
    import json

    import torch

    import palu
    from tiny import save_tiny, tiny_llama, tiny_tokenizer
    folder = save_tiny(tiny_llama(), tiny_tokenizer(), tmp_path / "tiny")
    model, _ = palu.load_model(str(folder))
    res = palu.compress(model, torch.randint(3, 97, (2, 32)), kept_ratio=0.7, group_size=2,
                        progress=False, model_id=str(folder))
    res.save(tmp_path / "ckpt")
    results = tmp_path / "results"
    results.mkdir()
    proc, out = _run("evaluate", f"model.id={folder}", "model.name=tiny", "method=palu",
                     f"method.checkpoint={tmp_path / 'ckpt'}", "method.latent_bits=4", "data.seqlen=64",
                     "data.max_tokens=128", tmp_path=results)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["metrics"]["group_size"] == 2 and result["metrics"]["kept_ratio_target"] == 0.7
    assert result["metrics"]["kv_bits"] == 4 and result["metrics"]["ppl"] > 1
    # the record holds what evaluate read, not the palu.* defaults that describe another checkpoint
    assert "palu" not in result["config"] and result["config"]["method"]["latent_bits"] == 4
    assert {"model", "data", "method"} <= set(result["config"])
