"""The prefill rows a decoding step may carry: a line fit over measured step times, floor and ceiling."""

import pytest

from justfit.engine.chunks import OVERHEAD_RATIO, ROUND, ChunkSizer


def _fed(sizer, fixed, per_row, rows=(16, 144, 512, 144, 16)):
    for n in rows:
        sizer.observe(n, fixed + per_row * n)
    return sizer


def test_floor_until_the_samples_tell_fixed_from_per_row_cost():
    s = ChunkSizer(128, 512)
    assert s.rows() == 128 and s.fit() is None  # nothing measured
    for _ in range(5):
        s.observe(132, 1.0)  # every step the same size: one point, no line
    assert s.fit() is None and s.rows() == 128


def test_rows_keep_the_fixed_cost_a_small_share_of_a_chunk():
    s = _fed(ChunkSizer(128, 512), fixed=0.25, per_row=0.01)
    fixed, per_row = s.fit()
    assert fixed == pytest.approx(0.25) and per_row == pytest.approx(0.01)
    want = OVERHEAD_RATIO * 0.25 / 0.01  # 200 rows: the fixed cost is 1/8 of the chunk's
    assert s.rows() == -(-int(want) // ROUND) * ROUND and s.rows() % ROUND == 0 and s.rows() >= want


def test_cheap_steps_keep_the_floor_and_costly_ones_stop_at_the_step_size():
    assert _fed(ChunkSizer(128, 512), fixed=0.05, per_row=0.0064).rows() == 128  # ~63 rows wanted: the floor
    assert _fed(ChunkSizer(128, 512), fixed=2.0, per_row=0.005).rows() == 512  # 3,200 wanted: the step's rows


def test_a_given_cap_is_kept_and_unphysical_fits_are_ignored():
    assert _fed(ChunkSizer(8, 512, adaptive=False), fixed=2.0, per_row=0.005).rows() == 8
    falling = ChunkSizer(128, 512)
    for n, t in ((16, 3.0), (512, 1.0), (144, 2.5)):  # bigger steps faster: noise, not a cost model
        falling.observe(n, t)
    assert falling.fit() is None and falling.rows() == 128
    ignored = ChunkSizer(128, 512)
    ignored.observe(0, 1.0)
    ignored.observe(10, -1.0)
    assert not ignored.samples
