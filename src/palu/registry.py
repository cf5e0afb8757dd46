"""The one way a kind of thing is registered by name: cache methods, long-context suites, rank
allocators, model families and (in the pipeline) fitted methods' specs.

A `Registry` is a dict that takes a name once. Each thing registers itself where it is defined,
by calling its registry's `register` (a method's class statement does it through
`CacheMethod.__init_subclass__`, a fitted spec through the `register_fitted` decorator); its
module is imported by its package (`palu.methods` finds its modules itself, the other packages
name theirs in `__init__.py`), so adding a kind is one file plus that registration.
"""
from __future__ import annotations

from typing import Any


class Registry(dict):
    """Names to things of one `kind` ("method", "rank allocator", ...): a second, different thing
    under a taken name is refused, naming both (`error`: the exception type to raise)."""

    def __init__(self, kind: str, error: type[Exception] = ValueError):
        super().__init__()
        self.kind, self.error = kind, error

    def register(self, name: str, thing: Any) -> Any:
        if not isinstance(name, str) or not name:
            raise self.error(f"a {self.kind} needs a non-empty name, got {name!r}")
        if name in self and not _same(self[name], thing):
            raise self.error(f"{self.kind} {name!r} is registered twice: {_where(self[name])} and {_where(thing)}")
        self[name] = thing
        return thing

    def copy(self) -> "Registry":
        """A registry of the same kind with the same entries (a test registers into its copy)."""
        out = Registry(self.kind, self.error)
        out.update(self)
        return out


def _same(old: Any, new: Any) -> bool:
    """The same definition met again (a module imported twice under one name, as a test's reload
    does) is not a second thing."""
    if old is new:
        return True
    return (isinstance(old, type) and isinstance(new, type)
            and (old.__module__, old.__qualname__) == (new.__module__, new.__qualname__))


def _where(thing: Any) -> str:
    module = getattr(thing, "__module__", None) or type(thing).__module__
    name = getattr(thing, "__qualname__", None) or type(thing).__qualname__
    return f"{module}.{name}"
