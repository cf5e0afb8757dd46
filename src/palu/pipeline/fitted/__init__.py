"""Methods whose state the DAG fits: one `FittedSpec` subclass each (base.py says what it
declares), registered by importing its module here."""
from palu.pipeline.fitted.base import FITTED, FittedSpec, fitted_kind, fitted_steps, register_fitted

from palu.pipeline.fitted import kvquant  # noqa: E402,F401  (registers KVQuantSpec)
from palu.pipeline.fitted import kivi_vscale  # noqa: E402,F401  (registers KIVIVScaleSpec)
