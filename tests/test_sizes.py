"""Size lists and bucketing."""

from __future__ import annotations

import pytest

from devgraph import DEFAULT_DECODE_SIZES, DEFAULT_PREFILL_SIZES, ConfigError, SizeSchedule, resolve_sizes
from devgraph.sizes import GiB, default_max_size


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
