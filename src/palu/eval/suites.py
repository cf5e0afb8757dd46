"""The long-context suites, one registration each (name -> settings, checks, runner, result tag).

A suite is one module that defines its settings dataclass (the single home of its defaults) and
calls `register_suite`. The pipeline's `longcontext.<name>` group is that dataclass; a run picks
one (`longcontext.suite=<name>`) and writes one result file named by the suite's `tag`.

- `needles`: RULER-style needle retrieval built here over the novels (`needles`), embedded.
- `qasper`: yes/no questions over the embedded full papers (`qasper`).
- `longbench`: THUDM LongBench from local files (`longbench`), for users who have them.
- `ruler`: RULER's own prepared files (`ruler`), for users who have them.

Every answer is generated through the method's cache after the prompt is prefilled into it,
`batch_size` prompts at a time (`generation.answer_batches`). Adding a suite: a module with its settings and `register_suite(Suite(...))`,
and its import in `palu/eval/__init__.py`.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Callable

from ..registry import Registry


@dataclass(frozen=True)
class Suite:
    name: str
    settings: type                                   # dataclass: every setting and its default
    # (model, tokenizer, method, settings, max_positions, log, batch_size) -> {"samples", "tasks", ...};
    # "tasks" maps task -> {"n", "score", "lo", "hi", "metric"}
    run: Callable[..., dict]
    tag: Callable[[Any, str], str]                   # (settings, dtype) -> result file name
    longest_prompt: Callable[[Any], int]             # prompt + answer tokens, checked vs the model
    # errors before any model is loaded: `check` the settings' ranges (every suite's, on every run),
    # `check_data` the data the suite reads (only when it runs: missing files, unknown tasks)
    check: Callable[[Any], None] = lambda s: None
    check_data: Callable[[Any], None] = lambda s: None
    # (tokenizer, settings, prompt_cache) -> (documents, key): a suite whose prompts take long to
    # build keeps them in `prompt_cache` for the grid's other jobs (palu.eval.prompt_cache); its
    # `run` takes `prompt_cache=<folder>` too
    prompts: Callable[..., tuple] | None = None

SUITES: Registry = Registry("long-context suite")

def register_suite(suite: Suite) -> Suite:
    if not is_dataclass(suite.settings):
        raise TypeError(f"suite {suite.name!r}: settings must be a dataclass")
    return SUITES.register(suite.name, suite)

def get_suite(name: str) -> Suite:
    if name not in SUITES:
        raise ValueError(f"longcontext.suite={name!r} is not one of {list(SUITES)}")
    return SUITES[name]

def settings_of(name: str, given) -> Any:
    """The suite's settings dataclass from a mapping (a dict or a config node); unknown keys named."""
    suite = get_suite(name)
    given = dict(given)
    known = {f.name for f in fields(suite.settings)}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(f"longcontext.{name} has no settings {unknown}; known: {sorted(known)}")
    return suite.settings(**given)

def check_limit(name: str, limit: int | None) -> None:
    if limit is not None and limit <= 0:
        raise ValueError(f"longcontext.{name}.limit={limit} must be positive or null")


def check_positive(name: str, settings, *keys: str) -> None:
    for key in keys:
        value = getattr(settings, key)
        if value is None or value <= 0:
            raise ValueError(f"longcontext.{name}.{key}={value!r} must be a positive integer")

def short_hash(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:8]

def local_files_tag(name: str, s, dtype: str) -> str:
    """The tag of a suite read from a user's folder: its tasks, limit and length, and the folder
    (and prompt file) by a hash of their path."""
    tasks = "+".join(s.tasks)
    tasks = tasks if len(tasks) <= 60 else f"{len(s.tasks)}tasks-{short_hash(tasks)}"
    prompts = "" if not getattr(s, "prompts", None) else f"-p{short_hash(str(s.prompts))}"
    limit = "all" if s.limit is None else s.limit
    return f"{name}-{tasks}-n{limit}-L{s.max_length}-d{short_hash(str(s.dir))}{prompts}-{dtype}"
