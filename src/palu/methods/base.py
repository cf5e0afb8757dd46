"""The contract every KV-cache method meets, and the registry that maps config names to classes.

A method is one dataclass (its hyper-parameters are its fields) in one file of this package,
and nothing else (the pipeline's `method=<name>` option is built from its fields). Evaluation,
generation and the tables only use this contract:

    method = build_method({"name": "palu", "checkpoint": "work/palu/...", "latent_bits": 4})
    method.install(model)              # change the model (Palu: factorised attention)
    cache = method.make_cache(model)   # what the model attends through, one per sequence
    model(ids, past_key_values=cache)  # perplexity sees exactly what the cache holds
    method.cache_nbytes(cache)         # bytes as stored, metadata included
    method.tag, method.summary()       # result names and table columns
"""
from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any, ClassVar

from ..registry import Registry


class MethodError(ValueError):
    """A method's config names an unknown method or field, or a bad value."""


REGISTRY: Registry = Registry("method", MethodError)   # filled by each method's class statement
_DISCOVERED = False   # every module of this package imported (`_discover`)


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
    # Whether `install` changes the model (its attention, its factors). A method object that does
    # belongs to the one model it was installed on: its per-model state (layer budgets, loaded
    # factors, codecs) is read by that model's layers (`_guard_install`, `_guard_make_cache`).
    changes_model: ClassVar[bool] = True
    # fields renamed since results were first recorded (old -> new): build_method refuses the old
    # key by the new name rather than as an unknown field
    renamed: ClassVar[dict[str, str]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.name:
            REGISTRY.register(cls.name, cls)
        # every install / make_cache a subclass writes is checked the same way (issue 51, item 4)
        if "install" in cls.__dict__:
            cls.install = _guard_install(cls.__dict__["install"])
        if "make_cache" in cls.__dict__:
            cls.make_cache = _guard_make_cache(cls.__dict__["make_cache"])

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


INSTALLED = "_palu_method"   # the model attribute naming the method installed on it


def installed_method(model) -> "CacheMethod | None":
    """The method object installed on `model` (None: none, or only `palu.compress`'s factors)."""
    return getattr(model, INSTALLED, None)


def _same_method(a, b) -> bool:
    # a deep copy of an installed model carries a copy of its method: the same settings serve it
    return a is b or (type(a) is type(b) and a.tag == b.tag)


def _guard_install(install):
    """One model per method object, one method per model: a method object installed on a second
    model would change the state the first model's layers read (a PyramidKV's layer budgets,
    say), and a method installed over another would run a mixture of the two."""
    @functools.wraps(install)
    def guarded(self, model):
        home = getattr(self, "_installed_on", None)
        home = home() if home is not None else None
        if home is not None and home is not model:
            raise MethodError(f"{self.name}: this method object is installed on another model already, "
                              "and its per-model state serves that model's layers; build one method "
                              "object per model (build_method(config), or dataclasses.replace(method))")
        present = installed_method(model)
        if present is self:
            raise MethodError(f"{self.name}: this method is installed on the model already")
        if present is not None:
            raise MethodError(f"{self.name}: the model has {present.name} installed already; methods "
                              "do not stack by installing one over another (the compositions that "
                              "exist are methods of their own: palu_snapkv, kivi_snapkv); load a fresh "
                              "model")
        if any(getattr(m, "stores_latents", False) for m in model.modules()):
            raise MethodError(f"{self.name}: the model carries Palu's factorised attention "
                              "(palu.compress / load_compressed); install on a fresh model")
        install(self, model)
        if self.changes_model:
            self._installed_on = weakref.ref(model)
            setattr(model, INSTALLED, self)
    return guarded


def _guard_make_cache(make_cache):
    @functools.wraps(make_cache)
    def guarded(self, model):
        present = installed_method(model)
        if self.changes_model and present is None:
            raise MethodError(f"{self.name}: method.install(model) before method.make_cache(model); "
                              "the cache is read by the attention the method installs")
        if present is not None and not _same_method(present, self):
            raise MethodError(f"{self.tag}: the model has {present.tag} installed, not this method; "
                              "make caches with the method installed on the model")
        return make_cache(self, model)
    return guarded


CacheMethod.install = _guard_install(CacheMethod.install)   # a method that installs nothing too


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


def family_of(summary: dict) -> str:
    """A method's family from its result summary (`CacheMethod.summary()` as a result file holds
    it): the family it states (eviction, selection, composition, a quantiser's name), else
    `palu` for a Palu checkpoint's run (its summary has the kept ratio) and the method's name
    otherwise (fp16). The one place a family is inferred: tables and figures map it further."""
    return summary.get("family") or ("palu" if "kept_ratio_target" in summary else summary["method"])


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
    old = sorted(set(config) & set(cls.renamed))
    if old:
        raise MethodError(f"method {name!r}: {', '.join(f'{k!r} is now {cls.renamed[k]!r}' for k in old)} "
                          "(README, 'One word per meaning of bits')")
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
