"""Answers generated through a method's cache: the prompt is prefilled into
`method.make_cache(model)` and the answer decoded greedily from it, so it can only come from what
the cache stores, never from K/V recomputed at full precision."""
from __future__ import annotations

import torch


@torch.no_grad()
def answer(model, tokenizer, method, prompt_ids: list[int], max_new_tokens: int = 24) -> str:
    """Greedy answer generated through the method's cache (None: the plain model)."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], device=device)
    kwargs = {} if method is None else {"past_key_values": method.make_cache(model)}
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=
                         tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
                         **kwargs)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
