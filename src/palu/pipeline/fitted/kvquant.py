"""KVQuant as a fitted method of the grid: its codebooks are fitted on calibration activations
(palu.calib.kvquant), captured once for every state of the same windows (`kvquant_capture`) and
fitted per bit width, weighting and outlier fraction (`fit_kvquant`); a grid lists the states
under `quantization.kvquant.fits`, and a suite or the memory table picks one by `kvquant_bits`."""
from __future__ import annotations

from dataclasses import dataclass

from palu.pipeline.fitted.base import CaptureSettings, FittedSpec, register_fitted


@dataclass
class KVQuantSettings(CaptureSettings):
    """Fitting KVQuant's codebooks (step fit_kvquant) on windows of the calibration corpus."""
    bits: int = 3
    weighting: str = "fisher"           # fisher (sensitivity-weighted k-means) | uniform (plain)
    outlier_fraction: float = 0.01      # entries per vector kept exact, in [0, 0.5)


@register_fitted
@dataclass(frozen=True)
class KVQuantSpec(FittedSpec):
    """One KVQuant state: the settings its codebooks are fitted with."""
    bits: int
    weighting: str
    outlier_fraction: float

    kind = "kvquant"
    settings = KVQuantSettings
    block = ("quantization", "kvquant")
    varied = ("bits", "weighting", "outlier_fraction")
    captures = True
    select_key = "kvquant_bits"
    table = "quantization"
    positive = ("samples", "seqlen", "tokens_per_window")

    @property
    def tag(self) -> str:
        from palu.methods.kvquant import state_tag
        return state_tag(self.bits, self.weighting, self.outlier_fraction)

    def selected_by(self, value) -> bool:
        return self.bits == value

    @classmethod
    def check(cls, settings) -> None:
        from palu.methods.kvquant import check_settings
        check_settings(settings["bits"], settings["weighting"], settings["outlier_fraction"])

    @classmethod
    def capture_gradients(cls, settings, for_state: bool) -> bool:
        # one capture serves every state: with the gradients fisher weighting needs; a fit
        # capturing for itself takes them only if its own weighting needs them
        return settings["weighting"] == "fisher" if for_state else True

    @classmethod
    def fit(cls, captured, settings, device: str):
        from palu.calib.kvquant import fit_from_activations
        return fit_from_activations(captured, settings["bits"], settings["weighting"],
                                    settings["outlier_fraction"], device=device)

    @classmethod
    def metrics(cls, made, settings) -> dict:
        from palu.methods.kvquant import KVQuantState
        return {**super().metrics(made, settings), **({"bits": made.bits} if isinstance(made, KVQuantState) else {})}
