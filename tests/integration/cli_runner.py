"""Run many entry-point invocations in one interpreter (tests/integration/test_cli_errors.py):
each case calls the step's Hydra `main` as its command line would (sys.argv), and its exit code,
output and whether it left any file behind are reported as one JSON list on stdout. One process
for every case: an interpreter and `import palu` cost ~6 s each, a case's own work ~0.1 s.

    python tests/integration/cli_runner.py CASES.json   # [{"step": ..., "argv": [...], "dir": ...}]
"""
import contextlib
import importlib
import io
import json
import os
import sys


def run_case(case: dict) -> dict:
    module = importlib.import_module(f"palu.pipeline.cli.{case['step']}")
    sys.argv = [case["step"], *case["argv"]]
    text = io.StringIO()
    code = 0
    with contextlib.redirect_stderr(text), contextlib.redirect_stdout(text):
        try:
            module.main()
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        except BaseException as err:   # noqa: BLE001 - reported as the case's failure
            print(f"{type(err).__name__}: {err}")
            code = 1
    return {"code": code, "output": text.getvalue(), "left": sorted(os.listdir(case["dir"]))}


def main(path: str) -> None:
    cases = json.loads(open(path).read())
    out = sys.stdout
    results = [run_case(case) for case in cases]
    out.write(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
