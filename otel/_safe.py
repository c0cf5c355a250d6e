"""Telemetry never raises into the request path: catch, count, log once per component.

`@guarded("component")` wraps a method of an object that has an `_errors: ErrorCounter` attribute.
An exception inside it is counted under the component, logged (with traceback the first time, then at
DEBUG), and the method returns `None`. Caller exceptions are never involved: telemetry methods do not
run caller code.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar

_log = logging.getLogger("tollgate.otel")

P = ParamSpec("P")
R = TypeVar("R")


class ErrorCounter:
    """Thread-safe counts of swallowed telemetry errors, by component (e.g. `span.finish`)."""

    __slots__ = ("_counts", "_lock")

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def record(self, component: str) -> None:
        with self._lock:
            first = component not in self._counts
            self._counts[component] = self._counts.get(component, 0) + 1
        if first:
            _log.warning(
                "telemetry error in %s (counted; later ones logged at DEBUG)", component, exc_info=True
            )
        else:
            _log.debug("telemetry error in %s", component, exc_info=True)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())


class _HasErrors(Protocol):
    _errors: ErrorCounter


S = TypeVar("S", bound=_HasErrors)


def guarded(
    component: str,
) -> Callable[[Callable[Concatenate[S, P], R]], Callable[Concatenate[S, P], R | None]]:
    """Method decorator: exceptions are counted in `self._errors` and swallowed (returns None)."""

    def decorate(method: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R | None]:
        @functools.wraps(method)
        def wrapper(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R | None:
            try:
                return method(self, *args, **kwargs)
            except Exception:  # noqa: BLE001 - telemetry must never raise into the request path
                self._errors.record(component)
                return None

        return wrapper

    return decorate
