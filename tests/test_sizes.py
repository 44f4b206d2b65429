"""Size lists and bucketing."""

from __future__ import annotations

import tracemalloc

import pytest

from devgraph import DEFAULT_DECODE_SIZES, DEFAULT_PREFILL_SIZES, ConfigError, SizeSchedule, resolve_sizes
from devgraph.flag.sizes import (
    HARD_MAX_SIZE,
    MAX_SIZE_COUNT,
    GiB,
    check_size,
    default_max_size,
    device_max_size,
)


def test_bucket_rounds_up_and_stops_past_max():
    schedule = SizeSchedule((1, 2, 4, 8))
    assert [schedule.bucket(n) for n in range(0, 10)] == [1, 1, 2, 4, 4, 8, 8, 8, 8, None]
    assert schedule.bucket(-1) is None


def test_defaults_cut_at_max_and_include_it():
    schedule = resolve_sizes("decode", max_size=100)
    assert schedule.max == 100
    assert all(s in DEFAULT_DECODE_SIZES for s in schedule.sizes[:-1])
    assert schedule.sizes == tuple(sorted(schedule.sizes))


def test_prefill_defaults_are_token_counts():
    schedule = resolve_sizes("prefill", max_size=512)
    assert schedule.sizes == tuple(s for s in DEFAULT_PREFILL_SIZES if s <= 512)


def test_default_max_follows_free_memory():
    assert default_max_size("decode", 4 * GiB) < default_max_size("decode", 70 * GiB)
    assert default_max_size("prefill", 70 * GiB) == 4096
    assert resolve_sizes("decode", free_bytes=4 * GiB).max == 16


def test_user_list_sorted_and_deduplicated():
    assert resolve_sizes("decode", [8, 1, 8, 4]).sizes == (1, 4, 8)


def test_truncation_warns_and_keeps_max(caplog):
    schedule = resolve_sizes("decode", [1, 8, 64, 128], max_size=32)
    assert schedule.sizes == (1, 8, 32)
    assert "[64, 128]" in caplog.text and "max_size=32" in caplog.text


@pytest.mark.parametrize("bad", [[0], [-1], [1.5], ["8"], [True]])
def test_bad_sizes_raise(bad):
    with pytest.raises(ConfigError):
        resolve_sizes("decode", bad)


def test_empty_list_raises():
    with pytest.raises(ConfigError):
        resolve_sizes("decode", [])


# -- bounds ------------------------------------------------------------------------------------------
def test_large_schedule_builds_no_max_sized_table():
    tracemalloc.start()
    try:
        schedule = SizeSchedule((1, 1 << 10, 1 << 20))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 * 1024  # a table of 2**20 + 1 entries alone would be 8 MiB
    assert [schedule.bucket(n) for n in (0, 1, 2, 1024, 1025, 1 << 20)] == [
        1,
        1,
        1024,
        1024,
        1 << 20,
        1 << 20,
    ]
    assert schedule.bucket((1 << 20) + 1) is None and schedule.bucket(-3) is None


def test_table_and_bisection_agree():
    small = SizeSchedule((3, 7, 100, 8192))
    big = SizeSchedule((3, 7, 100, 8192, 10_000))
    assert all(small.bucket(n) == big.bucket(n) for n in range(0, 8193))


@pytest.mark.parametrize(
    ("phase", "cap"), [("decode", 65536), ("verify", 65536), ("prefill", 1 << 20), ("encode", 1 << 20)]
)
def test_hard_cap_per_phase(phase, cap):
    assert HARD_MAX_SIZE[phase] == cap
    assert resolve_sizes(phase, [1, cap]).max == cap
    with pytest.raises(ConfigError) as info:
        resolve_sizes(phase, max_size=10**9)
    assert f"from 1 to {cap}" in str(info.value) and "hard cap" in str(info.value)


def test_device_cap_from_free_memory_is_named_with_the_hard_cap():
    # 1 GiB free, 4 KiB of static inputs a row: at most 1 GiB / 2 / 4 KiB = 131072 rows.
    assert device_max_size(GiB, 4096) == 131072
    assert resolve_sizes("prefill", max_size=131072, free_bytes=GiB, row_bytes=4096).max == 131072
    with pytest.raises(ConfigError) as info:
        resolve_sizes("prefill", max_size=131073, free_bytes=GiB, row_bytes=4096)
    message = str(info.value)
    assert "from 1 to 131072" in message and "hard cap" in message and "free memory (1.0 GiB)" in message
    assert "4096 bytes" in message


def test_default_max_never_exceeds_the_device_cap():
    assert resolve_sizes("prefill", free_bytes=64 * 1024 * 1024, row_bytes=1 << 20).max == 32


def test_size_list_length_is_bounded():
    assert len(resolve_sizes("prefill", list(range(1, MAX_SIZE_COUNT + 1)))) == MAX_SIZE_COUNT
    with pytest.raises(ConfigError, match=f"at most {MAX_SIZE_COUNT}"):
        resolve_sizes("prefill", list(range(1, 100_001)))
    with pytest.raises(ConfigError, match=f"at most {MAX_SIZE_COUNT}"):
        resolve_sizes("prefill", range(1, 10**9))


def test_huge_size_in_a_list_is_refused():
    with pytest.raises(ConfigError, match="hard cap"):
        resolve_sizes("decode", [1, 10**9])


@pytest.mark.parametrize("bad", [(), (4, 2), (1, 1), (0, 4), (1.5,), (True,), (1, 1 << 21)])
def test_schedule_checks_its_sizes(bad):
    with pytest.raises(ConfigError):
        SizeSchedule(bad)


def test_check_size_names_the_type():
    with pytest.raises(ConfigError, match=r"got 2\.0 \(a float\)"):
        check_size("decode", 2.0, "decode max_size")
