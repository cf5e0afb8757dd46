"""KV-cache methods: one class per method behind one contract (`base.CacheMethod`)."""
from .base import REGISTRY, CacheMethod, MethodError, build_method, family_of, method_names

__all__ = ["REGISTRY", "CacheMethod", "MethodError", "build_method", "family_of", "method_names"]
