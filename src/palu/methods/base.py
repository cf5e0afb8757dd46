"""The contract every KV-cache method meets, and the registry that maps config names to classes.

A method is one dataclass (its hyper-parameters are its fields) in one file of this package,
and nothing else (the pipeline's `method=<name>` option is built from its fields). Evaluation,
generation and the tables only use this contract:

    method = build_method({"name": "palu", "checkpoint": "work/palu/...", "bits": 4})
    method.install(model)              # change the model (Palu: factorised attention)
    cache = method.make_cache(model)   # what the model attends through, one per sequence
    model(ids, past_key_values=cache)  # perplexity sees exactly what the cache holds
    method.cache_nbytes(cache)         # bytes as stored, metadata included
    method.tag, method.summary()       # result names and table columns
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

REGISTRY: dict[str, type["CacheMethod"]] = {}
_DISCOVERED = False   # every module of this package imported (`_discover`)


class MethodError(ValueError):
    """A method's config names an unknown method or field, or a bad value."""


@dataclasses.dataclass
class CacheMethod:
    """Base of every method. Subclasses set `name`, add fields, and override what they change."""
    name: ClassVar[str] = ""
    # Whether a one-pass window through the cache means what decoding through it means (each
    # query sees what the cache would hold when that token is decoded). A method that evicts
    # after the prefill (SnapKV) has no such meaning: its one-pass logits are the full model's.
    one_pass: ClassVar[bool] = True
    # Whether the cache serves a left-padded batch of prompts exactly: every row gets what its
    # prompt gets alone (`palu.eval.generation.answer_batches` batches only such methods). A
    # method that sets it is held to it by tests/unit/test_padded_batches.py; the others refuse
    # a padded batch by name.
    padded_batches: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.name:
            if cls.name in REGISTRY and REGISTRY[cls.name].__qualname__ != cls.__qualname__:
                raise MethodError(f"two methods are named {cls.name!r}: "
                                  f"{REGISTRY[cls.name].__module__} and {cls.__module__}")
            REGISTRY[cls.name] = cls

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise MethodError for a bad field value (called on construction, before any work)."""

    @property
    def tag(self) -> str:
        """Names the method's results (a path component): every field that changes a number."""
        raise NotImplementedError

    def lineage(self) -> tuple[str, ...]:
        """What the method's state was made from, as path components after its tag in a result
        path (`naming.run_name`): a checkpoint's calibration settings, say. Default: nothing."""
        return ()

    def inputs(self) -> dict[str, str]:
        """The files the method's state is read from, by artifact kind (for lineage tracking).
        Default: none."""
        return {}

    def install(self, model) -> None:
        """Change `model` in place for this method (default: nothing)."""

    def make_cache(self, model):
        """A fresh transformers Cache that stores what this method stores."""
        raise NotImplementedError

    def cache_nbytes(self, cache) -> dict:
        """Bytes `cache` holds: {"data", "metadata", "total"} (metadata: scales, positions...)."""
        raise NotImplementedError

    def summary(self) -> dict:
        """Columns for result tables (bits, kept ratio, ...); what is absent takes the table's
        default (the unmodified model's value)."""
        return {"kv_bits": 16}

    def record(self) -> dict:
        """What a result file stores about the method: its config and anything it loaded."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        return {"name": self.name, **fields}


def check_int(value, key: str, minimum: int = 1) -> None:
    """A method's integer field: MethodError naming it unless an int >= minimum (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise MethodError(f"method.{key}={value!r} must be an integer >= {minimum}")


def check_one_pass(method, what: str) -> None:
    """Refuse a one-pass score (perplexity, lm-eval loglikelihoods) through a method without
    one-pass semantics: it would be the uncompressed model's number under the method's name."""
    if method is not None and not getattr(method, "one_pass", True):
        raise MethodError(f"{method.tag} evicts tokens after the prefill: a one-pass {what} through "
                          "its cache would be the full model's number. Evaluate it with the "
                          "decode-time suites (longcontext: prefill, evict, then generate)")


def method_names() -> list[str]:
    _discover()
    return sorted(REGISTRY)


def build_method(config: dict[str, Any]) -> CacheMethod:
    """The method a config dict names ({"name": ..., field: value, ...})."""
    _discover()
    config = dict(config)
    name = config.pop("name", None)
    if name not in REGISTRY:
        raise MethodError(f"method.name={name!r} is not one of {sorted(REGISTRY)}")
    cls = REGISTRY[name]
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(config) - fields)
    if unknown:
        raise MethodError(f"method {name!r} has no field(s) {unknown}; its fields: {sorted(fields)}")
    return cls(**config)


def _discover() -> None:
    """Import every module of this package once, so each method registers itself: adding a
    method is one file here, nothing else to edit."""
    global _DISCOVERED
    if _DISCOVERED:
        return
    import importlib
    import pkgutil

    from .. import methods
    for info in pkgutil.iter_modules(methods.__path__):
        importlib.import_module(f"{methods.__name__}.{info.name}")
    _DISCOVERED = True
