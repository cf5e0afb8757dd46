"""SentencePiece GGUF tokenizers tokenise as the model was trained (issue 55): the `tokenizers`-built
encoder equals a plainly written score-ordered merge (`spm_reference`) id for id, on a vocabulary
trained here and, where `make install-gemma3` assembled it, on Gemma-3's own; and the fidelity
check refuses the Unigram misreading of such a vocabulary by name."""
import re
from collections import Counter
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

import spm_reference
from palu.models.gguf_tokenizer import (BYTE, CONTROL, NORMAL, SPACE, UNKNOWN, USER_DEFINED, SpmVocab,
                                        read_spm_vocab, spm_backend)
from palu.models.tokenizer_check import (FIDELITY_TEXT, TokenizerFidelityError, check_tokenizer,
                                         tokenizer_fidelity)

GEMMA = Path(__file__).resolve().parents[2] / "work/models/gemma-3-270m-q4_k_m.gguf"
TRICKY = ["The history of the university began", "  two spaces,\n\nnewlines\n\n\nand\ttabs",
          "café naïve — “quotes” 🤗 中文 x=3.14*r**2", "<bos>control<eos> pieces inside text", " leading space"]


def _samples(n: int = 6, size: int = 300) -> dict[str, list[str]]:
    """`n` pieces of `size` characters of every embedded corpus (the model's evaluation text)."""
    from palu.data.corpora import STANDINS, load_corpus
    from palu.eval.qasper import load_qasper
    out = {}
    for name in STANDINS:
        text = load_corpus(name).evaluation_text
        out[name] = [text[i:i + size] for i in range(0, len(text) - size, len(text) // n)][:n]
    papers = [d.context for d in load_qasper(limit=n)]
    out["qasper"] = [p[len(p) // 2:len(p) // 2 + size] for p in papers]
    return out


def _train(text: str, merges: int = 300, add_space_prefix: bool = False) -> SpmVocab:
    """A SentencePiece-style BPE vocabulary learnt from `text`: each merge's piece scored by its
    rank (-rank: the first merge scores highest), as Gemma-3's GGUF holds them."""
    words = Counter(re.findall(f"{SPACE}?[^{SPACE}\\n]+", SPACE + text.replace(" ", SPACE)))
    split = {w: list(w) for w in words}
    learnt = []
    for _ in range(merges):
        pairs = Counter()
        for w, n in words.items():
            for a, b in zip(split[w], split[w][1:]):
                pairs[a, b] += n
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        learnt.append(a + b)
        for w in words:
            s, i = split[w], 0
            while i < len(s) - 1:
                if s[i] == a and s[i + 1] == b:
                    s[i:i + 2] = [a + b]
                i += 1
    pieces = ["<pad>", "<eos>", "<bos>", "<unk>", "\n", "\n\n", "  "]
    types = [CONTROL, CONTROL, CONTROL, UNKNOWN, USER_DEFINED, USER_DEFINED, USER_DEFINED]
    pieces += [f"<0x{b:02X}>" for b in range(256)]
    types += [BYTE] * 256
    learnt = list(dict.fromkeys(learnt))
    chars = sorted({c for w in words for c in w} - set(learnt))
    scores = [0.0] * len(pieces) + [-float(r) for r in range(len(learnt))] + [-1e6] * len(chars)
    return SpmVocab(pieces + learnt + chars, scores, types + [NORMAL] * (len(learnt) + len(chars)),
                    add_space_prefix=add_space_prefix, unk_id=3)


@pytest.fixture(scope="module")
def samples():
    return _samples()


@pytest.fixture(scope="module")
def trained(samples):
    return _train(" ".join(s for texts in samples.values() for s in texts[:3]) + " " + FIDELITY_TEXT)


def test_the_merge_order_is_by_score_not_by_unigram_likelihood():
    """`▁t` (0) + `he` (-5) merge on into `▁the` (-12): the pieces are merge priorities."""
    pieces = ["<unk>", SPACE, "t", "h", "e", f"{SPACE}t", "he", f"{SPACE}the"]
    vocab = SpmVocab(pieces, [0, -90, -91, -92, -93, 0, -5, -12], [UNKNOWN] + [NORMAL] * 7, unk_id=0)
    ids = spm_backend(vocab).encode(" the").ids
    assert [pieces[i] for i in ids] == [f"{SPACE}the"] == [pieces[i] for i in spm_reference.encode(vocab, " the")]


@pytest.mark.parametrize("space_prefix", [False, True])
def test_the_encoder_equals_the_score_ordered_merge_on_every_embedded_corpus(samples, trained, space_prefix):
    vocab = SpmVocab(trained.pieces, trained.scores, trained.types, space_prefix, trained.unk_id)
    tok = spm_backend(vocab)
    texts = [t for texts in samples.values() for t in texts] + TRICKY
    for text in texts:
        assert tok.encode(text).ids == spm_reference.encode(vocab, text), text[:60]
    assert tok.decode(tok.encode(TRICKY[2]).ids) == TRICKY[2]    # byte fallback decodes back


def test_the_fidelity_check_refuses_the_unigram_misreading_and_passes_the_merges(trained):
    from tokenizers import Tokenizer, normalizers
    from tokenizers.models import Unigram
    right = PreTrainedTokenizerFast(tokenizer_object=spm_backend(trained))
    assert check_tokenizer(right)["split"] == 0
    # what transformers 5.17 builds from a Gemma GGUF: the merge priorities as log-probabilities
    unigram = Tokenizer(Unigram(list(zip(trained.pieces, trained.scores)), unk_id=3, byte_fallback=True))
    unigram.normalizer = normalizers.Replace(" ", SPACE)
    wrong = PreTrainedTokenizerFast(tokenizer_object=unigram)
    f = tokenizer_fidelity(wrong)
    assert f["words"] >= 10 and f["split"] > 0.25 * f["words"], f
    with pytest.raises(TokenizerFidelityError, match=r"splits \d+ of \d+ common words.*'the' ->"):
        check_tokenizer(wrong, "the test tokenizer")


def test_a_tokenizer_cutting_text_far_below_its_vocabulary_is_refused(trained):
    """No countable words (a vocabulary without ▁/Ġ word forms) but far shorter pieces than the
    vocabulary holds: refused on bytes per token."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Split
    pieces = sorted(set(FIDELITY_TEXT) | set(re.findall(r"[A-Za-z]+", FIDELITY_TEXT)))
    vocab = {"[UNK]": 0, **{p: i + 1 for i, p in enumerate(pieces)}}
    chars = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    chars.pre_tokenizer = Split("", "isolated")
    with pytest.raises(TokenizerFidelityError, match="bytes per token"):
        check_tokenizer(PreTrainedTokenizerFast(tokenizer_object=chars))


@pytest.mark.skipif(not GEMMA.is_file(), reason="Gemma-3's GGUF is not assembled (make install-gemma3)")
def test_gemma3s_own_vocabulary_encodes_as_the_score_ordered_merge(samples):
    vocab = read_spm_vocab(GEMMA)
    tok = spm_backend(vocab)
    ids = tok.encode("The history of the university began").ids
    assert [vocab.pieces[i] for i in ids] == ["The", "▁history", "▁of", "▁the", "▁university", "▁began"]
    assert ids[1:5] == [4083, 529, 506, 10467]
    for text in [t for texts in samples.values() for t in texts] + TRICKY:
        assert ids_of(tok, text) == spm_reference.encode(vocab, text), text[:60]
    f = tokenizer_fidelity(PreTrainedTokenizerFast(tokenizer_object=tok))
    assert f["split"] == 0 and f["bytes_per_token"] > 4.5


def ids_of(tok, text):
    return tok.encode(text).ids
