"""bench/chaos_clock.py: a stepped node's log times mapped back to the real clock."""

from __future__ import annotations

from pathlib import Path

from bench.chaos_clock import FakeClock

HOUR = 3600.0


def clock_with(tmp_path: Path, steps: list[tuple[float, float]]) -> FakeClock:
    clock = FakeClock(tmp_path / "faketime")
    clock.steps = steps
    return clock


def test_no_steps_leave_times_alone(tmp_path: Path) -> None:
    assert clock_with(tmp_path, []).real_times([1.0, 2.0]) == [1.0, 2.0]


def test_a_step_forward_and_back(tmp_path: Path) -> None:
    t = 1_800_000_000.0
    clock = clock_with(tmp_path, [(t + 10, HOUR), (t + 20, 0.0)])
    logged = [t + 5, t + 12 + HOUR, t + 19 + HOUR, t + 25]
    assert clock.real_times(logged) == [t + 5, t + 12, t + 19, t + 25]


def test_a_step_back_and_forward(tmp_path: Path) -> None:
    """Lines written before a step back lie within its span read the other way: order decides."""
    t = 1_800_000_000.0
    clock = clock_with(tmp_path, [(t + 10, -HOUR), (t + 20, 0.0)])
    logged = [t + 5, t + 9, t + 12 - HOUR, t + 19 - HOUR, t + 21, t + 30]
    assert clock.real_times(logged) == [t + 5, t + 9, t + 12, t + 19, t + 21, t + 30]


def test_a_day_ahead_then_back_with_the_cache_interval(tmp_path: Path) -> None:
    """The node may see a step up to a second late: a line just after it still reads the old offset."""
    t = 1_800_000_000.0
    clock = clock_with(tmp_path, [(t + 10, 24 * HOUR), (t + 20, 0.0)])
    logged = [t + 10.5, t + 11 + 24 * HOUR, t + 20.5 + 24 * HOUR, t + 21]
    assert clock.real_times(logged) == [t + 10.5, t + 11, t + 20.5, t + 21]


def test_the_offset_file_is_what_libfaketime_reads(tmp_path: Path) -> None:
    clock = FakeClock(tmp_path / "faketime")
    assert clock.path.read_text() == "+0\n"
    clock.step(-86400)
    assert clock.path.read_text() == "-86400\n" and clock.offset == -86400
    env = clock.env()
    assert env["FAKETIME_TIMESTAMP_FILE"] == str(clock.path) and env["FAKETIME_DONT_FAKE_MONOTONIC"] == "1"
