"""otel/_safe.py: `guarded` swallows and counts telemetry errors; `ErrorCounter` counts by component."""

from __future__ import annotations

import logging
import threading

import pytest

from otel._safe import ErrorCounter, guarded


class Recorder:
    def __init__(self) -> None:
        self._errors = ErrorCounter()
        self.seen: list[object] = []

    @guarded("recorder.ok")
    def ok(self, value: int, *, scale: int = 1) -> int:
        self.seen.append(value)
        return value * scale

    @guarded("recorder.boom")
    def boom(self, exc: Exception) -> int:
        raise exc


@pytest.mark.parametrize(
    ("args", "kwargs", "expected"),
    [((2,), {}, 2), ((2,), {"scale": 3}, 6), ((0,), {"scale": 5}, 0)],
)
def test_a_method_that_does_not_raise_returns_its_value(args: tuple[int], kwargs: dict[str, int],
                                                        expected: int) -> None:
    recorder = Recorder()
    assert recorder.ok(*args, **kwargs) == expected
    assert recorder.seen == [args[0]]
    assert recorder._errors.counts() == {}


@pytest.mark.parametrize("exc", [ValueError("bad"), KeyError("k"), RuntimeError("x"), ZeroDivisionError()])
def test_an_exception_is_swallowed_counted_and_the_method_returns_none(exc: Exception) -> None:
    recorder = Recorder()
    assert recorder.boom(exc) is None
    assert recorder.boom(exc) is None
    assert recorder._errors.counts() == {"recorder.boom": 2}
    assert recorder._errors.total() == 2


def test_base_exceptions_are_not_swallowed() -> None:
    """Cancellation and interpreter exits pass through: only `Exception`s are telemetry errors."""
    recorder = Recorder()
    with pytest.raises(KeyboardInterrupt):
        recorder.boom(KeyboardInterrupt())  # type: ignore[arg-type]
    assert recorder._errors.counts() == {}


def test_wrapper_keeps_the_method_name_and_docstring() -> None:
    assert Recorder.ok.__name__ == "ok"
    assert Recorder.boom.__qualname__ == "Recorder.boom"


def test_the_first_error_of_a_component_is_a_warning_later_ones_debug(caplog: pytest.LogCaptureFixture) -> None:
    counter = ErrorCounter()
    with caplog.at_level(logging.DEBUG, logger="tollgate.otel"):
        for component in ("a", "a", "b", "a"):
            try:
                raise ValueError(component)
            except ValueError:
                counter.record(component)
    levels = [(r.levelno, r.getMessage().split(" ")[-1] if r.levelno == logging.DEBUG else r.getMessage())
              for r in caplog.records]
    assert [lvl for lvl, _ in levels] == [logging.WARNING, logging.DEBUG, logging.WARNING, logging.DEBUG]
    assert caplog.records[0].exc_info is not None  # the first one carries the traceback
    assert counter.counts() == {"a": 3, "b": 1}


def test_counts_returns_a_copy() -> None:
    counter = ErrorCounter()
    counter.record("x")
    snapshot = counter.counts()
    snapshot["x"] = 100
    assert counter.counts() == {"x": 1}


def test_concurrent_records_are_all_counted() -> None:
    counter = ErrorCounter()

    def hammer() -> None:
        for _ in range(2000):
            counter.record("c")

    logging.getLogger("tollgate.otel").setLevel(logging.ERROR)
    try:
        threads = [threading.Thread(target=hammer) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        logging.getLogger("tollgate.otel").setLevel(logging.NOTSET)
    assert counter.total() == 8000
