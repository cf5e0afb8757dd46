"""Answers generated through a method's cache: the prompt is prefilled into
`method.make_cache(model)` and the answer decoded greedily from it, so it can only come from what
the cache stores, never from K/V recomputed at full precision."""
from __future__ import annotations

import torch


def answer(model, tokenizer, method, prompt_ids: list[int], max_new_tokens: int = 24) -> str:
    """Greedy answer generated through the method's cache (None: the plain model)."""
    return answer_and_bytes(model, tokenizer, method, prompt_ids, max_new_tokens)[0]


@torch.no_grad()
def answer_and_bytes(model, tokenizer, method, prompt_ids: list[int], max_new_tokens: int = 24):
    """The answer, and the bytes its cache held at the end of it (stored, and read per decode
    step: they differ for selection methods; `method.cache_nbytes`), None for the plain model."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], device=device)
    cache = None if method is None else method.make_cache(model)
    kwargs = {} if cache is None else {"past_key_values": cache}
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=
                         tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
                         **kwargs)
    nbytes = None
    if cache is not None:
        n = method.cache_nbytes(cache)
        nbytes = {"stored": int(n["total"]), "read_per_step": int(n.get("read_per_step", n["total"])),
                  "tokens": int(out.shape[1] - 1)}   # the last token's K/V is never stored
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True), nbytes
