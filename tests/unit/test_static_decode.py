"""The static-cache decode path (`palu.eval.static_decode`, issue 49 item 4): on the CPU its
decode step runs eagerly on the same preallocated tensors a GPU captures as a CUDA graph, so these
float64 tests pin what the graph replays. Reference: transformers' `generate` (its dynamic cache
and mask) and the project's eager loop, on left-padded batches of prompts of different lengths."""
import copy

import pytest
import torch

from palu.eval import generation, static_decode
from palu.methods import build_method

from tiny import (PAD, PROMPTS, WordTok, left_padded, tiny_gemma3, tiny_llama, tiny_mistral_sliding, tiny_olmo2,
                  tiny_phi3, tiny_qwen2, tiny_qwen3)


def _mistral(seed):
    return tiny_mistral_sliding(seed, window=None)   # Mistral without a window: full attention


BUILDERS = {"llama": tiny_llama, "qwen2": tiny_qwen2, "qwen3": tiny_qwen3, "olmo2": tiny_olmo2,
            "phi3": tiny_phi3, "mistral": _mistral}


def _model(family: str, attn: str):
    model = BUILDERS[family](0).double()
    model.config._attn_implementation = attn
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", sorted(static_decode.FAMILIES))
def test_every_row_of_a_padded_batch_equals_its_prompt_alone_through_generate(family, attn):
    """Each row, every step's logits within 1e-9 of the model run once over that prompt and its
    answer alone, no cache and no padding (the unfactorised reference), and the same tokens as
    transformers' `generate` on the prompt alone. The reference runs SDPA: transformers' eager
    attention takes its softmax in float32 (2e-8 from SDPA in float64); the static path attends
    through SDPA for an eager model too (its prefill causal, its decode steps grouped)."""
    assert family in BUILDERS, f"{family} is served by the static path: add a tiny model of it here"
    model = _model(family, attn)
    assert static_decode.unsupported(model, None) is None
    tol = 1e-9
    ids, mask = left_padded(PROMPTS)
    trace = []
    new, _ = static_decode.greedy_static(model, ids, mask, 6, set(), graph=False, trace=trace)
    assert len(trace) == 6
    for row, prompt in enumerate(PROMPTS):
        alone = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=PAD)
        assert new[row] == alone[0, len(prompt):].tolist()
        exact = copy.deepcopy(model)
        exact.config._attn_implementation = "sdpa"
        with torch.no_grad():
            once = exact(torch.tensor([prompt + new[row]])).logits[0, len(prompt) - 1:]
        for k, ours in enumerate(trace):
            assert (ours[row] - once[k]).abs().max().item() < tol, f"row {row} step {k}"
    assert model.config._attn_implementation == attn   # restored
    assert not hasattr(model.config, "_palu_static_inner")


def test_an_unpadded_batch_and_batch_one():
    model = _model("llama", "sdpa")
    for prompts in ([PROMPTS[1]], [PROMPTS[0], PROMPTS[0][::-1]]):
        ids = torch.tensor(prompts)
        ref = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=PAD)
        new, _ = static_decode.greedy_static(model, ids, None, 5, set(), graph=False)
        assert new == ref[:, ids.shape[1]:].tolist()


def test_rows_stop_at_their_first_stop_token_as_in_the_eager_loop():
    model = _model("llama", "sdpa")
    ids, mask = left_padded(PROMPTS)
    free, _ = static_decode.greedy_static(model, ids, mask, 8, set(), graph=False)
    stop = {free[1][2], free[2][0]}   # row 1 ends at its third token, row 2 at its first
    new, _ = static_decode.greedy_static(model, ids, mask, 8, stop, graph=False)
    eager = generation._decode_dropping_ended_rows(model, generation.DynamicCache(), ids, mask, 8, stop)
    assert new == [n for n, _ in eager]
    assert len(new[2]) == 1 and len(new[1]) <= 3


# six rows whose free answers (tiny llama, seed 0) meet SHRINKING's stop tokens at their second or
# third token, but for rows 1 and 4, which never do in 12 steps: after step 1, 3 of 6 rows live
SIX = PROMPTS + [p[::-1] for p in PROMPTS]
SHRINKING = {8, 73, 82}


def test_ended_rows_leave_the_batch_and_the_rest_decode_as_before():
    """Once at most half the batch is live the step keeps only the live rows (a GPU captures it
    again): their logits within 1e-9 of the batch that kept every row, the answers the eager loop's."""
    model = _model("llama", "sdpa")
    ids, mask = left_padded(SIX)
    full = []
    free, _ = static_decode.greedy_static(model, ids, mask, 12, set(), graph=False, trace=full)
    ends = [next((k for k, t in enumerate(n) if t in SHRINKING), 11) for n in free]
    assert ends == [2, 11, 1, 1, 11, 1], "the tiny model changed: pick SHRINKING again"
    trace = []
    new, cache = static_decode.greedy_static(model, ids, mask, 12, SHRINKING, graph=False, trace=trace)
    eager = generation._decode_dropping_ended_rows(model, generation.DynamicCache(), ids, mask, 12, SHRINKING)
    assert new == [n for n, _ in eager]
    # rows 2, 3, 5 left after step 1 (3 of 6 live); row 0 ended at step 2 but stays (2 of 3 live)
    assert cache.layers[0].keys.shape[0] == 3 and cache.layers[-1].values.shape[0] == 3
    assert len(trace) == 12
    for k, (ours, ref) in enumerate(zip(trace, full)):
        for row, end in enumerate(ends):
            if k <= end:
                assert (ours[row] - ref[row]).abs().max().item() < 1e-9, f"row {row} step {k}"
        assert torch.isnan(ours[[2, 3, 5]]).all() == (k > 1)


def test_shrinking_waits_for_half_the_batch_and_enough_steps():
    done = [True, False, True, False]
    assert static_decode.shrink_rows(done, [0, 1, 2, 3], 1, 12) == [1, 3]
    assert static_decode.shrink_rows([True, False, False, False], [0, 1, 2, 3], 1, 12) is None   # 3 of 4 live
    assert static_decode.shrink_rows(done, [0, 1, 2, 3], 8, 12) is None    # 3 steps left
    assert static_decode.shrink_rows([True] * 4, [0, 1, 2, 3], 1, 12) is None   # nothing to keep
    assert static_decode.shrink_rows(done, [1, 3], 2, 12) is None           # both live


def test_replayed_graphs_shrink_only_when_asked(monkeypatch):
    monkeypatch.delenv("PALU_STATIC_DECODE", raising=False)
    assert static_decode.shrinks(graph=False) and not static_decode.shrinks(graph=True)
    monkeypatch.setenv("PALU_STATIC_DECODE", "all")
    assert static_decode.shrinks(graph=True)


def test_answers_and_bytes_equal_the_eager_loops_for_fp16_as_rows_leave():
    model = _model("llama", "sdpa")
    method = build_method({"name": "fp16"})

    ids, mask = left_padded(SIX)
    ours = generation._generate_static(model, WordTok(), method, SIX, 12, ids, mask, SHRINKING)
    dynamic = generation.DynamicCache()
    eager = generation._decode_dropping_ended_rows(model, dynamic, ids, mask, 12, SHRINKING,
                                                   generation._RowBytesNow(method, dynamic, SIX))
    assert [a for a, _ in ours] == [" ".join(map(str, n)) for n, _ in eager]
    assert [b for _, b in ours] == [b for _, b in eager]


def test_answers_and_bytes_equal_the_eager_loops_for_fp16():
    model = _model("llama", "sdpa")
    method = build_method({"name": "fp16"})

    ids, mask = left_padded(PROMPTS)
    ours = generation._generate_static(model, WordTok(), method, PROMPTS, 5, ids, mask, set())
    eager = generation._generate(model, WordTok(), method, PROMPTS, 5)   # the CPU takes the eager loop
    assert ours == eager


def test_who_it_serves():
    llama = _model("llama", "sdpa")
    assert static_decode.unsupported(llama, None) is None
    assert static_decode.unsupported(llama, build_method({"name": "fp16"})) is None
    assert "own cache" in static_decode.unsupported(llama, build_method({"name": "snapkv", "compression_ratio": 0.5}))
    assert "sliding" in static_decode.unsupported(tiny_mistral_sliding(0), None)
    assert static_decode.unsupported(tiny_gemma3(0), None) is not None
    flash = copy.deepcopy(llama)
    flash.config._attn_implementation = "flex_attention"
    assert "flex_attention" in static_decode.unsupported(flash, None)


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("PALU_STATIC_DECODE", "0")
    assert not static_decode.enabled()
    monkeypatch.setenv("PALU_STATIC_DECODE", "1")
    assert static_decode.enabled()
