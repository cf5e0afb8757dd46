"""A step's answers journaled as they come, so a long-context or zero-shot job that is stopped (a
SLURM time limit, a preemption, a GPU lease ending) resumes where it stopped instead of from its
first prompt (zero-shot: lm-eval's log-likelihood requests, `zeroshot.method_lm(journal=...)`).

Inside `answer_journal(path, fingerprint)`, `generation.answer_batches` looks every prompt up
before answering it and appends each batch's answers (one JSON line per prompt: the prompt's
hash, its answer and bytes) once the batch is done. An answer depends only on the prompt, the
answer length, the method and the model (a batch answers each row as that prompt alone:
tests/unit/test_padded_batches.py), so answers journaled at any batch size serve any other.

The first line is the fingerprint of what produced the answers (the caller's: method, suite
settings, model, dtype); a journal of anything else is refused by name, never mixed in. A line cut
short by a kill is ignored. The caller removes the journal once its result file is written.
"""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import os
from pathlib import Path

_CURRENT: contextvars.ContextVar = contextvars.ContextVar("palu_answer_journal", default=None)


def _line(obj) -> str:
    return json.dumps(obj, sort_keys=True, default=str)


class AnswerJournal:
    def __init__(self, path: str | Path, fingerprint: dict):
        self.path = Path(path)
        self.header = _line({"fingerprint": fingerprint})
        self.known: dict[str, list] = {}
        if self.path.is_file():
            lines = self.path.read_text().split("\n")
            if lines[0] != self.header:
                raise ValueError(f"answer journal {self.path} holds answers of other settings "
                                 f"({lines[0][:200]}...); remove it to start this step afresh")
            for text in lines[1:]:
                try:
                    entry = json.loads(text)
                except json.JSONDecodeError:     # the last line of a killed job, cut short
                    continue
                self.known[entry["key"]] = entry["answer"]
            if lines[-1]:                        # cut short: what is appended starts a line of its own
                with self.path.open("a") as f:
                    f.write("\n")
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(self.header + "\n")

    @staticmethod
    def key(prompt: list[int], max_new_tokens: int) -> str:
        return hashlib.sha256(_line([list(map(int, prompt)), int(max_new_tokens)]).encode()).hexdigest()

    def get(self, prompt, max_new_tokens):
        found = self.known.get(self.key(prompt, max_new_tokens))
        return None if found is None else (found[0], found[1])

    def add(self, answered: list[tuple[list[int], int, tuple]]) -> None:
        """Append (prompt, answer length, (text, bytes)) of one batch, on disk before returning."""
        lines = []
        for prompt, new, answer in answered:
            key = self.key(prompt, new)
            self.known[key] = list(answer)
            lines.append(_line({"key": key, "answer": list(answer)}))
        with self.path.open("a") as f:
            f.write("\n".join(lines) + "\n")
            f.flush()
            os.fsync(f.fileno())

    @staticmethod
    def request_key(kind: str, args) -> str:
        """An lm-eval request's key (its kind and its strings: what the answer depends on, given
        the journal's fingerprint)."""
        return hashlib.sha256(_line([kind, list(args)]).encode()).hexdigest()

    def lookup(self, key: str):
        return self.known.get(key)

    def add_keyed(self, items: list[tuple[str, list]]) -> None:
        """Append (key, answer) pairs, on disk before returning."""
        if not items:
            return
        for key, answer in items:
            self.known[key] = answer
        with self.path.open("a") as f:
            f.write("\n".join(_line({"key": k, "answer": a}) for k, a in items) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def __len__(self) -> int:
        return len(self.known)


def current() -> AnswerJournal | None:
    return _CURRENT.get()


@contextlib.contextmanager
def answer_journal(path: str | Path | None, fingerprint: dict):
    """Journal (and resume) the answers generated inside; None: no journal."""
    if path is None:
        yield None
        return
    journal = AnswerJournal(path, fingerprint)
    token = _CURRENT.set(journal)
    try:
        yield journal
    finally:
        _CURRENT.reset(token)
