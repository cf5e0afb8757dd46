"""Palu + TOVA (a composition, issue 49's eviction contract): a Palu checkpoint's latents of at most
`budget` tokens per layer; whenever a step leaves more, the tokens the step's last query attends
to least (averaged over every query head: one set per layer, `palu_evict.py`) are evicted — TOVA's
own scorer (`tova.py`) over the latent storage. Decoding one token at a time is the method, so
one-pass scores are refused (`one_pass`)."""
from __future__ import annotations

from dataclasses import dataclass

from .base import check_int
from .palu_evict import PaluEviction
from .tova import TovaPolicy


@dataclass
class PaluTova(PaluEviction):
    name = "palu_tova"
    budget: int = 512        # tokens whose latents a layer holds

    def check(self) -> None:
        super().check()
        check_int(self.budget, "budget")

    @property
    def method_suffix(self) -> str:
        return f"-tova-n{self.budget}"

    @property
    def eviction(self) -> TovaPolicy:
        return TovaPolicy(self.budget)

    def summary(self) -> dict:
        return {**super().summary(), "family": "composition", "budget": self.budget}
