"""Recovery after compression: LoRA refinement of the latent projections (recover/lora.py)."""
from .lora import LoraRecovery, factors_of, recover

__all__ = ["LoraRecovery", "factors_of", "recover"]
