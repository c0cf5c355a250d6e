"""`bench.instructions`: the count is read from the dumps callgrind wrote on the bench's own trigger
only (the dump at exit, and any earlier one, hold warm-up and start-up)."""

from __future__ import annotations

from pathlib import Path

from bench.instructions import total_instructions


def test_only_the_bench_dumps_are_counted(tmp_path: Path) -> None:
    (tmp_path / "callgrind.out.7.1").write_text("desc: Trigger: dump bench\nsummary: 1200\n")
    (tmp_path / "callgrind.out.7.2").write_text("desc: Trigger: dump bench\nsummary: 300\n")
    (tmp_path / "callgrind.out.7").write_text("desc: Trigger: Program termination\nsummary: 99999\n")
    (tmp_path / "other.txt").write_text("desc: Trigger: dump bench\nsummary: 5\n")
    assert total_instructions(tmp_path) == 1500


def test_no_dump_counts_nothing(tmp_path: Path) -> None:
    assert total_instructions(tmp_path) == 0
