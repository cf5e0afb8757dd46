"""One registration style (issue 52 item 3): methods, long-context suites, rank allocators, model
families and fitted methods' specs are each one `palu.registry.Registry`, which every thing of that
kind calls where it is defined; a second, different thing under a taken name is refused naming
both definitions, in the kind's own error type."""
import dataclasses

import pytest

from palu.registry import Registry


def test_a_registry_takes_a_name_once_and_names_both_definitions():
    reg = Registry("widget", KeyError)
    first = reg.register("w", object())
    assert reg["w"] is first and reg.register("w", first) is first    # the same thing again: fine
    with pytest.raises(KeyError, match=r"widget 'w' is registered twice: builtins.object and builtins.object"):
        reg.register("w", object())
    with pytest.raises(KeyError, match="a widget needs a non-empty name"):
        reg.register("", object())
    twin = reg.copy()
    twin.register("v", 1)
    assert isinstance(twin, Registry) and "v" not in reg and twin.kind == "widget"


def test_a_class_defined_again_under_its_own_name_is_the_same_definition():
    reg = Registry("class")
    first = type("A", (), {"__module__": "m"})
    again = type("A", (), {"__module__": "m"})     # a module imported twice (a test's reload)
    assert reg.register("a", first) is first and reg.register("a", again) is again
    with pytest.raises(ValueError, match=r"m\.A and m\.B"):
        reg.register("a", type("B", (), {"__module__": "m"}))


def test_every_kind_registers_through_one_registry_type(monkeypatch):
    from palu.decompose.ranks import ALLOCATORS, Allocator, register_allocator
    from palu.eval.suites import SUITES, register_suite
    from palu.methods import CacheMethod, MethodError, base, method_names
    from palu.models.adapters import ADAPTERS, FamilyAdapter, UnsupportedArchitectureError, register_family
    from palu.pipeline.fitted import FITTED, register_fitted
    import palu.decompose  # noqa: F401  (its modules register the allocators)
    import palu.eval  # noqa: F401  (and the suites)
    method_names()
    for reg in (base.REGISTRY, SUITES, ALLOCATORS, ADAPTERS, FITTED):
        assert isinstance(reg, Registry) and len(reg) >= 2, reg.kind

    monkeypatch.setattr(base, "REGISTRY", base.REGISTRY.copy())
    with pytest.raises(MethodError, match="method 'kivi' is registered twice: palu.methods.kivi.KIVI and"):
        @dataclasses.dataclass
        class OtherKivi(CacheMethod):
            name = "kivi"
    with pytest.raises(ValueError, match="rank allocator 'fisher' is registered twice"):
        register_allocator("fisher", Allocator(None, units=lambda *a: None))
    with pytest.raises(ValueError, match="long-context suite 'needles' is registered twice"):
        register_suite(dataclasses.replace(SUITES["needles"], run=lambda *a: None))
    with pytest.raises(UnsupportedArchitectureError, match="model family 'llama' is registered twice"):
        register_family("llama", FamilyAdapter(rope=False, layers_attr="x"))
    with pytest.raises(ValueError, match="fitted method 'kvquant' is registered twice"):
        register_fitted(type("KVQuantAgain", (FITTED["kvquant"],), {}))
