"""Calibration statistics of an unmodified model: the Gram of each K/V projection's inputs
(`collect_grams`), the Fisher information of the projections (`collect_fisher`), and KVQuant's
fitted codebooks (`palu.calib.kvquant`). A sweep computes them once and passes them to
`palu.compress(..., grams=..., fisher_stats=...)`."""
from .fisher import FisherWindows, collect_fisher
from .gram import collect_grams

__all__ = ["FisherWindows", "collect_fisher", "collect_grams"]
