"""`fast_init`: a frozen, slotted dataclass's `__init__`, as fast as a mutable one's.

Why: `@dataclass(frozen=True)` makes instances immutable by overriding `__setattr__`, so its generated
`__init__` stores every field through `object.__setattr__(self, name, value)`: a global lookup, an
attribute lookup and a generic set per field, about 120 ns each, four to five times a plain store. A
proxied step builds some two dozen such value objects (its call, answer, usage, reservation, guard
decisions, ledger entry, span labels), ~150 fields: measured under callgrind, ~108 k of the ~1,870 k
instructions of a request. With `slots=True` each field is a slot whose member descriptor can be set
directly; `fast_init` generates an `__init__` that does exactly that, so instances stay just as frozen
(`__setattr__` still refuses) and everything else the dataclass made (`__eq__`, `__hash__`, `__repr__`,
`__match_args__`, pickling, `dataclasses.replace`) is unchanged.

Contract: `cls` is a `@dataclass(frozen=True, slots=True)` class. The new `__init__` takes the same
parameters, in the same order, with the same defaults; `default_factory` is called per instance as the
dataclass does; fields with `init=False` get their default; `__post_init__` runs last. `InitVar`,
`KW_ONLY` and keyword-only fields are refused (TypeError at decoration): nothing here uses them. So is
a class whose `__init__` its body wrote (or that has none: `init=False`), and one where a field is no
longer a slot (a subclass shadowed it): replacing those would change what the class does. The
dataclass's own `__init__` is told apart by its origin (compiled from a string, as `dataclasses` does),
so one its author compiled with `exec` is not recognised. A subclass that inherits the new `__init__`
without being a dataclass itself is built by the dataclass's own `__init__`, exactly as before.
Applied at class creation (import time of the class's module, like `@dataclass` itself).
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from typing import Any, TypeVar

__all__ = ["fast_init"]

T = TypeVar("T")


def fast_init(cls: type[T]) -> type[T]:
    """Replace `cls.__init__` (see the module docstring); returns `cls`."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or not params.init or "__slots__" not in vars(cls):
        raise TypeError(f"fast_init: {cls.__qualname__} is not a @dataclass(frozen=True, slots=True)")
    # the generated __init__ replaces the dataclass's own (compiled from "<string>"), never one the class
    # body wrote: that one does what its author wrote and is not ours to drop
    own = vars(cls).get("__init__")
    if own is None or getattr(getattr(own, "__code__", None), "co_filename", None) != "<string>":
        raise TypeError(f"fast_init: {cls.__qualname__} defines its own __init__")
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]  # a dataclass: checked above
    # each field must still be a slot: a subclass may have shadowed one with a property or a plain value
    for f in fields:
        if not isinstance(inspect.getattr_static(cls, f.name, None), types.MemberDescriptorType):
            raise TypeError(f"fast_init: {cls.__qualname__}.{f.name} is not a slot")
    # the dataclass's own __init__ says what it takes: an InitVar is an extra parameter, KW_ONLY fields
    # are keyword-only ones; neither is supported
    taken = list(inspect.signature(own).parameters.values())[1:]
    expected = [f.name for f in fields if f.init]
    if [p.name for p in taken] != expected or any(p.kind is not p.POSITIONAL_OR_KEYWORD for p in taken):
        raise TypeError(f"fast_init: {cls.__qualname__} has an InitVar or keyword-only fields")
    # the generated code's own names (`self`, setters, defaults) take a prefix no field starts with, so
    # a field named `self` or `_set_x` cannot shadow one
    prefix = "_fi_"
    while any(f.name.startswith(prefix) for f in fields):
        prefix += "_"
    this = f"{prefix}self" if any(f.name == "self" for f in fields) else "self"
    # a factory field's parameter defaults to the dataclass's own marker (shown as `<factory>`), so
    # the signature is the dataclass's
    markers = {p.name: p.default for p in taken}
    scope: dict[str, Any] = {}
    signature: list[str] = []
    body: list[str] = []
    for i, f in enumerate(fields):
        setter, default, factory, marker = (f"{prefix}{kind}{i}" for kind in ("set", "default", "factory", "marker"))
        scope[setter] = getattr(cls, f.name).__set__  # the slot's member descriptor
        has_default = f.default is not dataclasses.MISSING
        has_factory = f.default_factory is not dataclasses.MISSING
        if has_default:
            scope[default] = f.default
        if has_factory:
            scope[factory] = f.default_factory
        if not f.init:
            if has_default:
                body.append(f"{setter}({this}, {default})")
            elif has_factory:
                body.append(f"{setter}({this}, {factory}())")
            continue  # no default: left unset for __post_init__, as the dataclass does
        if has_default:
            signature.append(f"{f.name}={default}")
            body.append(f"{setter}({this}, {f.name})")
        elif has_factory:
            scope[marker] = markers[f.name]
            signature.append(f"{f.name}={marker}")
            body.append(f"{setter}({this}, {factory}() if {f.name} is {marker} else {f.name})")
        else:
            signature.append(f.name)
            body.append(f"{setter}({this}, {f.name})")
    if hasattr(cls, "__post_init__"):
        body.append(f"{this}.__post_init__()")
    # a subclass that is not itself a dataclass inherits this __init__, and may have shadowed a field
    # (a slot of its own, a property) after `cls` was checked: it gets the dataclass's own __init__,
    # which looks every name up on the instance's class, as it always did
    scope[f"{prefix}type"], scope[f"{prefix}cls"], scope[f"{prefix}plain"] = type, cls, own
    passed = "".join(f", {f.name}" for f in fields if f.init)
    body.insert(0, f"if {prefix}type({this}) is not {prefix}cls:\n"
                   f"        return {prefix}plain({this}{passed})")
    lines = "".join(f"    {line}\n" for line in body)
    source = f"def __init__({this}{''.join(', ' + p for p in signature)}):\n{lines}"
    namespace: dict[str, Any] = {}
    exec(source, scope, namespace)  # noqa: S102 - generated from the dataclass's own field names, as dataclasses does
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__doc__ = own.__doc__
    init.__annotations__ = dict(own.__annotations__)
    setattr(cls, "__init__", init)  # noqa: B010 - a method assigned after the class exists
    return cls
