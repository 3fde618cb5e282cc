"""`http2.FrameBucket`, the per-connection bucket of small DATA frames (sans-IO:
every time is given), and what `H2Limits` and the settings give it."""

from __future__ import annotations

import pytest

from waygate.core.settings import SettingsError, load_settings
from waygate.proxy.app import Settings
from waygate.proxy.http2 import FrameBucket, H2Limits


def test_a_fresh_bucket_is_full_and_a_burst_within_it_reads_on():
    bucket = FrameBucket(rate=1000, burst=500, now=10.0)
    assert bucket.charge(500, 10.0) == 0.0
    assert bucket.level == 0.0


def test_past_the_bucket_the_wait_is_the_debt_at_the_rate():
    bucket = FrameBucket(rate=1000, burst=500, now=0.0)
    assert bucket.charge(2500, 0.0) == pytest.approx(2.0)  # 2,000 frames in debt
    # Read again once the wait is over: the debt is paid, the bucket at zero.
    assert bucket.charge(0, 2.0) == 0.0
    assert bucket.level == pytest.approx(0.0)


def test_a_read_before_the_debt_is_paid_waits_for_all_of_it():
    bucket = FrameBucket(rate=1000, burst=100, now=0.0)
    assert bucket.charge(1100, 0.0) == pytest.approx(1.0)
    assert bucket.charge(500, 0.5) == pytest.approx(1.0)  # 500 still owed + 500 more


def test_the_bucket_refills_at_its_rate_up_to_its_burst_only():
    bucket = FrameBucket(rate=100, burst=50, now=0.0)
    assert bucket.charge(50, 0.0) == 0.0
    assert bucket.charge(10, 0.1) == 0.0  # 10 earned in 0.1 s
    assert bucket.charge(1, 0.1) == pytest.approx(0.01)
    # An hour idle saves the burst, not an hour's worth.
    assert bucket.charge(50, 3600.0) == 0.0
    assert bucket.charge(1, 3600.0) == pytest.approx(0.01)


def test_a_steady_stream_at_the_rate_never_waits():
    # 400 messages 1 ms apart: 1,000 a second, under the default rate.
    limits = H2Limits()
    bucket = FrameBucket(limits.small_data_rate, limits.small_data_burst, now=0.0)
    assert all(bucket.charge(1, i * 0.001) == 0.0 for i in range(400))
    # 2,000 at once (a gRPC client stream of small messages): within the burst.
    assert FrameBucket(limits.small_data_rate, limits.small_data_burst, 0.0).charge(2000, 0.0) == 0


def test_settings_give_the_limits_their_small_data_bucket():
    settings = Settings(h2_small_data_rate=300, h2_small_data_burst=40)
    limits = settings.h2_limits()
    assert (limits.small_data_rate, limits.small_data_burst) == (300, 40)
    defaults = Settings().h2_limits()
    assert (defaults.small_data_rate, defaults.small_data_burst) == (5000, 5000)
    assert defaults.control_frames == 200


@pytest.mark.parametrize("name", ["h2_small_data_rate", "h2_small_data_burst"])
def test_an_empty_bucket_is_refused_at_start(name):
    with pytest.raises(SettingsError, match=name):
        load_settings(Settings, flags={name: 0}, env={})
