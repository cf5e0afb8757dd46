"""Built long-context prompts kept on disk, keyed by everything that builds them.

The RULER-style suite builds each prompt on the CPU by tokenising it whole a few times (~0.2 s a
prompt at 32K tokens): a grid's 3,200 prompts took each of its long-context jobs ~5 minutes
before the first answer, every job and every lease again (session 53's lease held GPU slots idle
for it). The prompts do not depend on the method, so one build serves every job of a grid: the
first job to build writes them (atomically) to `<folder>/<name>-<key>.json.gz`, and a job whose
key matches reads them back. The key is a sha256 over the builder's inputs -- the tokenizer
(its whole serialised vocabulary and rules, chat template, special tokens), the settings, the
texts the prompts are cut from -- and the source of the modules that build them, so an edit of
any of these builds anew instead of reading a stale file. The file also holds the key and the
inputs' description, checked on read: a file renamed onto another key is refused, not used.
"""
from __future__ import annotations

import dataclasses
import gzip
import hashlib
import inspect
import json
import logging
from pathlib import Path
from typing import Callable

from ..artifacts import atomic_path
from .documents import Document

FORMAT = 1
log = logging.getLogger(__name__)   # a hit or a build is always said (the job's log), progress or not


def tokenizer_fingerprint(tokenizer) -> str | None:
    """sha256 of what the tokenizer does (a fast tokenizer's serialised state, chat template,
    special tokens and BOS / EOS habits); None for a tokenizer without a serialised state (then
    nothing is cached: its behaviour cannot be keyed)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    # a call with truncation= or padding= leaves them set on the backend: state of the last call,
    # not of what the tokenizer does (prompts are built without them)
    state = {k: v for k, v in json.loads(backend.to_str()).items() if k not in ("truncation", "padding")}
    h = hashlib.sha256()
    for part in (json.dumps(state, sort_keys=True), str(getattr(tokenizer, "chat_template", None)),
                 json.dumps(getattr(tokenizer, "special_tokens_map", {}), sort_keys=True, default=str),
                 str(getattr(tokenizer, "add_bos_token", None)), str(getattr(tokenizer, "add_eos_token", None)),
                 type(tokenizer).__name__):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def sources_fingerprint(*modules) -> str:
    h = hashlib.sha256()
    for module in modules:
        h.update(inspect.getsource(module).encode())
        h.update(b"\0")
    return h.hexdigest()


def cache_key(tokenizer, settings, texts: dict[str, str], modules: tuple) -> tuple[str, dict] | None:
    """(key, what it covers) for prompts built by `modules` from `settings` and `texts` with
    `tokenizer`; None when the tokenizer cannot be keyed."""
    tok = tokenizer_fingerprint(tokenizer)
    if tok is None:
        return None
    inputs = {"format": FORMAT, "tokenizer": tok,
              "settings": dataclasses.asdict(settings) if dataclasses.is_dataclass(settings) else settings,
              "texts": {name: hashlib.sha256(text.encode()).hexdigest() for name, text in sorted(texts.items())},
              "sources": sources_fingerprint(*modules)}
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()
    return key, inputs


def cached_documents(folder: str | Path | None, name: str, keyed: tuple[str, dict] | None,
                     build: Callable[[], list[Document]]) -> tuple[list[Document], str | None]:
    """The documents `build()` makes, read from `folder` when a file of the same key is there,
    else built and written there. (documents, key); no folder or no key: built, key None."""
    if folder is None or keyed is None:
        return build(), None
    key, inputs = keyed
    path = Path(folder) / f"{name}-{key[:24]}.json.gz"
    if path.is_file():
        with gzip.open(path, "rt", encoding="utf-8") as f:
            held = json.load(f)
        if held.get("key") != key or held.get("inputs") != json.loads(json.dumps(inputs, default=str)):
            raise ValueError(f"{path}: holds prompts of another key or inputs than its name says "
                             f"({str(held.get('key'))[:24]}...): remove it, it was not written for these")
        docs = [Document(**d) for d in held["documents"]]
        log.info("%d prompts read from %s (built once for the grid's jobs)", len(docs), path)
        return docs, key
    docs = build()
    with atomic_path(path) as tmp:
        with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=6) as f:
            json.dump({"key": key, "inputs": inputs, "documents": [dataclasses.asdict(d) for d in docs]},
                      f, default=str)
    log.info("%d prompts built and kept in %s", len(docs), path)
    return docs, key
