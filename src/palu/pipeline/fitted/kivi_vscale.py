"""KIVI with calibrated per-channel value scales (palu.methods.kivi_vscale) as a fitted method of
the grid: values captured once on calibration windows (`kivi_vscale_capture`), scales fitted per
migration strength `alpha` (`fit_kivi_vscale`); a grid lists them under
`quantization.kivi_vscale.fits`, each with KIVI's own fields (bits, group, residual) for its run."""
from __future__ import annotations

from dataclasses import dataclass

from palu.pipeline.fitted.base import CaptureSettings, FittedSpec, register_fitted


@dataclass
class KIVIVScaleSettings(CaptureSettings):
    """Fitting the value scales (step fit_kivi_vscale) on windows of the calibration corpus."""
    samples: int = 4                    # calibration windows (values only: no gradients)
    alpha: float = 0.5                  # s_c = max|v_c|^alpha: 0 leaves KIVI as it is


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
    def fit(cls, captured, settings, device: str):
        from palu.calib.value_scales import fit_value_scales
        return fit_value_scales(captured, settings["alpha"])
