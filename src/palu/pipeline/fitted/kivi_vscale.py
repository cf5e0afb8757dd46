"""KIVI with calibrated per-channel value scales (palu.methods.kivi_vscale) as a fitted method of
the grid: values captured once on calibration windows (`kivi_vscale_capture`), scales fitted per
migration strength `alpha` (`fit_kivi_vscale`); a grid lists them under
`quantization.kivi_vscale.fits`, each with KIVI's own fields (bits, group, residual) for its run."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from palu.pipeline.fitted.base import FittedSpec, register_fitted


@dataclass
class KIVIVScaleSettings:
    """Fitting the value scales (step fit_kivi_vscale) on windows of the calibration corpus."""
    alpha: float = 0.5                  # s_c = max|v_c|^alpha: 0 leaves KIVI as it is
    samples: int = 4                    # calibration windows
    seqlen: int = 2048
    seed: int = 2
    tokens_per_window: int = 256        # tokens per window whose values are kept
    activations: Optional[str] = None   # fit from this capture (step kivi_vscale_capture); null: capture here


@register_fitted
@dataclass(frozen=True)
class KIVIVScaleSpec(FittedSpec):
    """One run: the scales' alpha, and KIVI's fields for the cache (`options`)."""
    alpha: float
    options: tuple = ()

    kind = "kivi_vscale"
    settings = KIVIVScaleSettings
    block = ("quantization", "kivi_vscale")
    varied = ("alpha",)
    method_fields = ("bits", "group", "residual")
    captures = True
    table = "quantization"
    positive = ("samples", "seqlen", "tokens_per_window")

    @property
    def tag(self) -> str:
        from palu.methods.kivi_vscale import state_tag
        return state_tag(self.alpha)

    def run_tag(self) -> str:
        from palu.methods.kivi import KIVI
        return f"{KIVI(**dict(self.options)).tag}-{self.tag}"

    @classmethod
    def check(cls, settings) -> None:
        from palu.methods.kivi_vscale import check_alpha
        check_alpha(settings["alpha"])

    @classmethod
    def capture(cls, model, windows, settings, info: dict, progress: bool, for_state: bool = False):
        from palu.calib.kvquant import capture_activations
        return capture_activations(model, windows, fisher=False, tokens_per_window=settings["tokens_per_window"],
                                   seed=settings["seed"], progress=progress, info=info)

    @classmethod
    def load_capture(cls, path: str):
        from palu.calib.kvquant import KVQuantActivations
        return KVQuantActivations.load(path)

    @classmethod
    def fit(cls, captured, settings, device: str):
        from palu.calib.value_scales import fit_value_scales
        return fit_value_scales(captured, settings["alpha"])

    @classmethod
    def metrics(cls, made, settings) -> dict:
        return {"tokens": made.info["tokens"]}
