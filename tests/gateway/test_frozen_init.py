"""`fast_init` gives a frozen slotted dataclass the same `__init__` contract, only faster."""

from __future__ import annotations

import ast
import copy
import dataclasses
import inspect
import pickle
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.call import Usage
from gateway.frozen_init import fast_init

ROOT = Path(__file__).resolve().parents[2]


def both(namespace: dict[str, Any]) -> tuple[type, type]:
    """The same class body made twice: a plain frozen slotted dataclass, and one with `fast_init`."""
    plain = dataclass(frozen=True, slots=True)(type("Value", (), dict(namespace)))
    fast = fast_init(dataclass(frozen=True, slots=True)(type("Value", (), dict(namespace))))
    return plain, fast


def fields_of(obj: object) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}  # type: ignore[arg-type]


SHAPES: dict[str, dict[str, Any]] = {
    "required only": {"__annotations__": {"a": "int", "b": "str"}},
    "defaults": {"__annotations__": {"a": "int", "b": "str", "c": "float"}, "b": "x", "c": 1.5},
    "factory": {"__annotations__": {"a": "int", "items": "list[int]"}, "items": field(default_factory=list)},
    "init=False with default": {"__annotations__": {"a": "int", "seen": "int"}, "seen": field(default=7, init=False)},
    "init=False with factory": {"__annotations__": {"a": "int", "memo": "dict[str, int]"},
                                "memo": field(default_factory=dict, init=False)},
    "no fields": {"__annotations__": {}},
}
CALLS: dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]] = {
    "required only": [((1, "y"), {}), ((), {"b": "z", "a": 2})],
    "defaults": [((1,), {}), ((1, "q"), {}), ((1,), {"c": 2.5}), ((1, "r", 3.0), {})],
    "factory": [((1,), {}), ((1, [2, 3]), {}), ((1,), {"items": [4]})],
    "init=False with default": [((1,), {})],
    "init=False with factory": [((1,), {})],
    "no fields": [((), {})],
}


@pytest.mark.parametrize("shape", SHAPES)
def test_same_signature_values_and_behaviour(shape: str) -> None:
    plain, fast = both(SHAPES[shape])
    assert inspect.signature(fast) == inspect.signature(plain)
    for args, kwargs in CALLS[shape]:
        a, b = plain(*args, **kwargs), fast(*args, **kwargs)
        assert fields_of(a) == fields_of(b)
        assert repr(a) == repr(b)
        assert b == fast(*args, **kwargs)
        if shape not in ("factory", "init=False with factory"):  # a list or dict field is unhashable, in both
            assert hash(b) == hash(fast(*args, **kwargs))
        assert copy.deepcopy(b) == b and type(copy.copy(b)) is fast
        if dataclasses.fields(b):
            name = dataclasses.fields(b)[0].name
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(b, name, None)
            with pytest.raises(dataclasses.FrozenInstanceError):
                delattr(b, name)


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((), {}, "missing 1 required positional argument: 'a'"),
        ((1, "x", 2.0, 9), {}, "takes from 2 to 4 positional arguments but 5 were given"),
        ((1,), {"a": 2}, "got multiple values for argument 'a'"),
        ((1,), {"nope": 2}, "got an unexpected keyword argument 'nope'"),
    ],
)
def test_wrong_arguments_fail_as_the_dataclass_does(args: tuple[Any, ...], kwargs: dict[str, Any], message: str) -> None:
    plain, fast = both(SHAPES["defaults"])
    for cls in (plain, fast):
        with pytest.raises(TypeError, match=message.replace("(", r"\(").replace(")", r"\)")):
            cls(*args, **kwargs)


def test_a_factory_default_is_fresh_per_instance_and_a_passed_value_is_kept() -> None:
    _, fast = both(SHAPES["factory"])
    first, second = fast(1), fast(2)
    assert first.items == [] and first.items is not second.items
    given_list = [1]
    assert fast(3, given_list).items is given_list


def test_post_init_runs_last_and_may_set_init_false_fields() -> None:
    calls: list[tuple[int, int]] = []

    def post(self: Any) -> None:
        calls.append((self.a, self.b))
        object.__setattr__(self, "key", f"{self.a}:{self.b}")

    plain, fast = both({"__annotations__": {"a": "int", "b": "int", "key": "str"}, "b": 2,
                        "key": field(init=False, repr=False, compare=False), "__post_init__": post})
    assert fast(1).key == plain(1).key == "1:2"
    assert calls == [(1, 2), (1, 2)]


def test_a_gateway_value_pickles_and_copies() -> None:
    usage = Usage(input_tokens=3, output_tokens=4, other_models=(("m", Usage(input_tokens=1)),))
    assert pickle.loads(pickle.dumps(usage)) == usage == copy.deepcopy(usage)
    assert Usage.__init__.__qualname__ == "Usage.__init__" and Usage.__init__.__module__ == "gateway.call"


def test_replace_and_match_args_still_work() -> None:
    _, fast = both(SHAPES["defaults"])
    value = fast(1)
    assert dataclasses.replace(value, b="new") == fast(1, "new")
    assert fast.__match_args__ == ("a", "b", "c")


def test_an_inherited_field_is_set_through_the_base_slot() -> None:
    base = dataclass(frozen=True, slots=True)(type("Base", (), {"__annotations__": {"a": "int"}}))
    child = fast_init(dataclass(frozen=True, slots=True)(type("Child", (base,), {"__annotations__": {"b": "int"}})))
    value = child(1, 2)
    assert (value.a, value.b) == (1, 2)


BASE_A = dataclass(frozen=True, slots=True)(type("BaseA", (), {"__annotations__": {"a": "int"}}))


def outcome(make: Any) -> tuple[str, Any]:
    """What building an instance gives: its fields, or the error's type and message."""
    try:
        return "built", fields_of(make())
    except (AttributeError, TypeError) as exc:
        return type(exc).__name__, str(exc)


@pytest.mark.parametrize(
    "subclass",
    [
        pytest.param({"__slots__": ("a",)}, id="a slot of its own for a field"),
        pytest.param({"a": property(lambda s: 42)}, id="a property over a field"),
        pytest.param({"__slots__": ("extra",)}, id="a slot of its own for something else"),
        pytest.param({}, id="nothing of its own"),
    ],
)
def test_a_plain_subclass_built_later_behaves_as_with_the_dataclass_init(subclass: dict[str, Any]) -> None:
    plain, fast = both({"__annotations__": {"a": "int", "b": "list[int]"}, "b": field(default_factory=list)})
    plain_sub, fast_sub = type("Sub", (plain,), dict(subclass)), type("Sub", (fast,), dict(subclass))
    assert outcome(lambda: fast_sub(1)) == outcome(lambda: plain_sub(1))
    assert outcome(lambda: fast_sub(1, [2])) == outcome(lambda: plain_sub(1, [2]))


def test_a_hand_written_init_is_refused_not_replaced() -> None:
    made = dataclass(frozen=True, slots=True)(
        type("H", (), {"__annotations__": {"a": "int"}, "__init__": lambda s, a: object.__setattr__(s, "a", a * 2)}))
    with pytest.raises(TypeError, match="its own __init__"):
        fast_init(made)
    assert made(2).a == 4


@pytest.mark.parametrize("names", [("self", "other"), ("_set_a", "a"), ("_fi_set0", "_fi_self", "self", "x"),
                                   ("_factory_b", "b"), ("_marker_items", "items")])
def test_field_names_that_look_like_its_own_names_are_kept_apart(names: tuple[str, ...]) -> None:
    namespace: dict[str, Any] = {"__annotations__": dict.fromkeys(names, "Any")}
    namespace[names[-1]] = field(default_factory=list)
    plain, fast = both(namespace)
    assert inspect.signature(fast) == inspect.signature(plain)
    values = {name: f"value of {name}" for name in names}
    assert fields_of(fast(**values)) == fields_of(plain(**values)) == values
    assert fields_of(fast(*list(values.values())[:-1])) == fields_of(plain(*list(values.values())[:-1]))


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: dataclass(slots=True)(type("M", (), {"__annotations__": {"a": "int"}})), id="not frozen"),
        pytest.param(lambda: dataclass(frozen=True)(type("N", (), {"__annotations__": {"a": "int"}})), id="no slots"),
        pytest.param(lambda: type("P", (), {}), id="not a dataclass"),
        pytest.param(lambda: dataclass(frozen=True, slots=True)(
            type("I", (), {"__annotations__": {"a": "int", "scale": InitVar[int]}, "__post_init__": lambda s, scale: None})),
            id="InitVar"),
        pytest.param(lambda: dataclass(frozen=True, slots=True, kw_only=True)(type("K", (), {"__annotations__": {"a": "int"}})),
                     id="keyword-only"),
        pytest.param(lambda: dataclass(frozen=True, slots=True, init=False)(type("F", (), {"__annotations__": {"a": "int"}})),
                     id="init=False"),
        pytest.param(lambda: dataclass(frozen=True, slots=True)(
            type("H", (), {"__annotations__": {"a": "int"}, "__init__": lambda s, a: object.__setattr__(s, "a", a * 2)})),
            id="hand-written __init__"),
        pytest.param(lambda: type("S", (BASE_A,), {"__slots__": (), "__init__": BASE_A.__init__, "a": property(lambda s: 1)}),
                     id="a field shadowed by a property"),
    ],
)
def test_what_it_cannot_keep_the_contract_of_is_refused(make: Any) -> None:
    with pytest.raises(TypeError, match="fast_init"):
        fast_init(make())


@given(st.integers(), st.text(), st.floats(allow_nan=False))
def test_any_values_are_stored_as_given(a: int, b: str, c: float) -> None:
    plain, fast = both(SHAPES["defaults"])
    assert fields_of(fast(a, b, c)) == fields_of(plain(a, b, c)) == {"a": a, "b": b, "c": c}


def test_every_frozen_slotted_dataclass_of_the_gateway_uses_it() -> None:
    """The hot path builds these per step; one left on the slow `__init__` is a silent regression."""
    missing = []
    for package in ("gateway", "guards", "otel", "grammars"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.ClassDef):
                    continue
                decorators = [ast.unparse(d) for d in node.decorator_list]
                frozen = any(d.startswith(("dataclass(", "dataclasses.dataclass(")) and "frozen=True" in d and "slots=True" in d for d in decorators)
                if frozen and decorators[0] != "fast_init":
                    missing.append(f"{path.relative_to(ROOT)}:{node.name}")
    assert missing == []
