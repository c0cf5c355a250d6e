import asyncio

from gateway.keyed_lock import KeyedLocks, WriteMarks


async def test_holders_of_one_key_take_turns() -> None:
    locks, order = KeyedLocks(), []

    async def hold(name: str, gate: asyncio.Event | None) -> None:
        async with locks.hold("run"):
            order.append(f"{name}+")
            if gate is not None:
                await gate.wait()
            order.append(f"{name}-")

    gate = asyncio.Event()
    first = asyncio.create_task(hold("a", gate))
    await asyncio.sleep(0)
    second = asyncio.create_task(hold("b", None))
    await asyncio.sleep(0)
    assert order == ["a+"] and len(locks) == 1  # b waits on the same lock
    gate.set()
    await asyncio.gather(first, second)
    assert order == ["a+", "a-", "b+", "b-"]
    assert len(locks) == 0  # nobody holds or waits: the key is gone


async def test_keys_are_independent() -> None:
    locks = KeyedLocks()
    async with locks.hold("a"):
        await asyncio.wait_for(_enter(locks, "b"), 1)  # not blocked by "a"
        assert len(locks) == 1


async def _enter(locks: KeyedLocks, key: str) -> None:
    async with locks.hold(key):
        pass


async def test_a_cancelled_waiter_leaves_no_entry() -> None:
    locks = KeyedLocks()
    async with locks.hold("run"):
        waiter = asyncio.create_task(_enter(locks, "run"))
        await asyncio.sleep(0)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert len(locks) == 1
    assert len(locks) == 0


def test_write_marks_move_per_key() -> None:
    marks = WriteMarks()
    before = marks.version("run")
    marks.bump("other")
    assert marks.version("run") == before  # another key's write
    marks.bump("run")
    assert marks.version("run") != before


def test_write_marks_start_afresh_past_their_limit_and_never_repeat_a_version() -> None:
    marks = WriteMarks(limit=2)
    marks.bump("a")
    seen = marks.version("a")
    marks.bump("b")
    marks.bump("c")  # a third key: the table starts afresh under a new generation
    assert marks.version("a") != seen and marks.version("a") == (1, 0)
