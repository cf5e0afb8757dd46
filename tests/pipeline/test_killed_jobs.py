"""A job killed on its way dies with its shell (issue 34, item 5): SIGTERM to a rule's shell used
to leave the Python step running, re-parented to PID 1; Snakemake recorded the failure, the
orphan then wrote its output, and the rerun took it as done. Every rule now `exec`s its step, so
the shell Snakemake signals is the step itself."""
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import ROOT, TEST_WORK

pytestmark = pytest.mark.slow
SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))


def _cmdline(p) -> str:
    """A process's command line; "" for one that exited meanwhile (Snakemake's short-lived
    helpers: a zombie's cmdline raises on a loaded machine)."""
    try:
        return " ".join(p.cmdline())
    except (psutil.ZombieProcess, psutil.NoSuchProcess, psutil.AccessDenied):
        return ""


def test_sigterm_to_a_rules_shell_ends_its_step_and_leaves_no_output(prepared_model):
    work = ROOT / "work" / "killed-job"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(prepared_model, work / "models" / "smollm2-135m")
    rel = work.relative_to(ROOT)
    target = f"{rel}/results/runs/smollm2-135m/fp16/ppl-wiki_standin-L128-T256-float32-cf0.3.json"
    proc = subprocess.Popen([SNAKEMAKE, "--cores", "1", "--configfile", "conf/grid/small.yaml", "--config",
                             f"work={rel}", f"results={rel}/results", "--", target],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        shell, deadline = None, time.time() + 3600   # a guard against a hang, not a speed limit
        while shell is None and time.time() < deadline:
            for child in psutil.Process(proc.pid).children():      # the rule's shell
                if "palu.pipeline.cli.evaluate" in _cmdline(child):
                    shell = child
            time.sleep(0.2)
        assert shell is not None, "the evaluate job never started"
        # the job's process tree as it runs: with `exec`, the shell is the step
        steps = [p for p in [shell, *shell.children(recursive=True)] if "palu.pipeline.cli.evaluate" in _cmdline(p)
                 and "python" in p.name()]
        assert steps, [p.cmdline() for p in [shell, *shell.children(recursive=True)]]
        shell.send_signal(signal.SIGTERM)
        out, _ = proc.communicate()
        assert proc.returncode != 0
        time.sleep(3)
        alive = [p for p in steps if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not alive, f"the step outlived its shell: {[p.pid for p in alive]}"
        time.sleep(15)       # an orphan would have finished by now (the step takes ~10 s)
        assert not (ROOT / target).exists()
    finally:
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(work, ignore_errors=True)
