import gzip
import json

import pytest
import torch

from palu.data.corpora import CorpusNotAvailableError, load_corpus, split_documents
from palu.data.windows import calibration_windows, evaluation_windows


@pytest.mark.parametrize("name", ["wiki_standin", "novels_standin"])
def test_embedded_standins_split_into_disjoint_parts(name):
    c = load_corpus(name)
    assert c.standin and "stand-in" in c.label
    calib = set(c.calibration_text.split("\n\n"))
    evals = set(c.evaluation_text.split("\n\n"))
    assert len(calib) > 50 and len(evals) > 100
    assert not calib & evals
    assert load_corpus(name).evaluation_text == c.evaluation_text  # deterministic


def test_split_is_by_document_and_stable():
    docs = [f"document number {i}" for i in range(200)] + ["document number 3"]
    a = split_documents(docs, 0.3)
    assert a == split_documents(list(reversed(docs))[::-1], 0.3)
    assert 30 < len(a[0].split("\n\n")) < 90


def test_wikitext2_local_files(tmp_path):
    (tmp_path / "wiki.train.raw").write_text(" = Train = \n\n Some training text . \n")
    (tmp_path / "wiki.test.raw").write_text(" = Valkyria = \n\n The game began development in 2010 . \n")
    c = load_corpus("wikitext2", path=str(tmp_path))
    assert not c.standin and "Valkyria" in c.evaluation_text and "training" in c.calibration_text


def test_c4_local_shards(tmp_path):
    for split, texts in (("train", ["train doc a", "train doc b"]), ("validation", ["val doc 1", "val doc 2"])):
        with gzip.open(tmp_path / f"c4-{split}.00000-of-00008.json.gz", "wt") as f:
            for t in texts:
                f.write(json.dumps({"text": t, "timestamp": "2019", "url": "x"}) + "\n")
    c = load_corpus("c4", path=str(tmp_path))
    assert c.evaluation_text == "val doc 1 val doc 2"
    assert "train doc b" in c.calibration_text


def test_ptb_local_files(tmp_path):
    (tmp_path / "ptb.train.txt").write_text(" aer banknote berlitz \n pierre <unk> N years old \n")
    (tmp_path / "ptb.test.txt").write_text(" no it was n't black monday \n")
    c = load_corpus("ptb", path=str(tmp_path))
    assert "black monday" in c.evaluation_text


def test_missing_and_unknown_corpora_fail_clearly(tmp_path):
    with pytest.raises(CorpusNotAvailableError, match="wiki.train.raw"):
        load_corpus("wikitext2", path=str(tmp_path))
    with pytest.raises(ValueError, match="unknown corpus 'wikitxt'"):
        load_corpus("wikitxt")


def test_evaluation_windows_are_non_overlapping():
    tokens = torch.arange(1000)
    w = evaluation_windows(tokens, 100, max_tokens=350)
    assert w.shape == (3, 100) and torch.equal(w.flatten(), torch.arange(300))
    with pytest.raises(ValueError, match="a window needs at least 2 tokens"):
        evaluation_windows(tokens, 0)
    with pytest.raises(ValueError, match="no full window"):
        evaluation_windows(tokens, 2000)


def test_calibration_windows_are_seeded():
    tokens = torch.arange(5000)
    a = calibration_windows(tokens, 4, 64, seed=0)
    assert torch.equal(a, calibration_windows(tokens, 4, 64, seed=0))
    assert not torch.equal(a, calibration_windows(tokens, 4, 64, seed=1))
    assert torch.equal(a[:, 1:] - a[:, :-1], torch.ones(4, 63, dtype=torch.long))


def test_real_corpora_are_read_from_the_local_cache_only(monkeypatch):
    # "Nothing is ever downloaded at run time": the HF datasets loader runs in offline mode
    # (online, an offline machine also waited ~25 s for connection timeouts)
    import os
    import sys
    import types

    from palu.data.corpora import _hf
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    seen = {}

    def load_dataset(*args, **kwargs):
        seen["offline"] = os.environ.get("HF_DATASETS_OFFLINE")
        return "cached"

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    assert _hf("wikitext2", "wikitext", "wikitext-2-raw-v1") == "cached" and seen["offline"] == "1"


def test_the_mix_corpus_holds_both_domains_part_by_part():
    """mix_standin alternates the two stand-ins' documents: its calibration part is exactly
    their calibration parts (nothing of either evaluation part), its evaluation part theirs."""
    from palu.data.corpora import load_corpus
    wiki, novels, mix = (load_corpus(n) for n in ("wiki_standin", "novels_standin", "mix_standin"))
    for part in ("calibration_text", "evaluation_text"):
        docs = getattr(mix, part).split("\n\n")
        expected = getattr(wiki, part).split("\n\n") + getattr(novels, part).split("\n\n")
        assert sorted(docs) == sorted(expected), part
        # alternating: the first documents come from both sources
        head = set(docs[:2])
        assert head & set(getattr(wiki, part).split("\n\n")) and head & set(getattr(novels, part).split("\n\n"))
    assert not set(mix.calibration_text.split("\n\n")) & set(mix.evaluation_text.split("\n\n"))
