"""The prefill rows a decoding step may carry: a fit over measured step times (rows and keys), floor and ceiling."""

import random

import pytest

from justfit.scheduler_chunks import OVERHEAD_RATIO, ROUND, ChunkSizer, chunk_keys


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
    fixed, per_row, per_key = s.fit()
    assert fixed == pytest.approx(0.25) and per_row == pytest.approx(0.01) and per_key == 0  # no keys observed
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


def _deepening(sizer, fixed, per_row, per_key, noise=0.0, seed=0):
    """Steps of a 4k prompt filling beside decoders: (rows, keys, seconds) as the engine observes them."""
    rng = random.Random(seed)
    for depth in range(0, 4096, 256):
        for decoders, rows in ((0, 512), (4, 128), (8, 32)):
            keys = chunk_keys(depth, rows) + decoders * (depth + 1)
            cost = fixed + per_row * (rows + decoders) + per_key * keys
            sizer.observe(rows + decoders, cost * (1 + rng.uniform(-noise, noise)), keys)
    return sizer


def test_the_fit_tells_a_row_from_the_keys_it_attends_to():
    fixed, per_row, per_key = _deepening(ChunkSizer(128, 512), 0.03, 0.0103, 4.5e-6, noise=0.05).fit()
    assert 0 <= fixed < 0.3  # seconds a step; small next to 5% noise on steps of up to ~12 s
    assert per_row == pytest.approx(0.0103, rel=0.15) and per_key == pytest.approx(4.5e-6, rel=0.15)


def test_chunks_shrink_as_the_prompt_deepens():
    s = _deepening(ChunkSizer(32, 512), 0.2, 0.01, 4.5e-6)
    shallow, deep = s.rows(4, 4 * 4097, 0), s.rows(4, 4 * 4097, 3500)
    assert 32 <= deep < shallow <= 512
    fixed, per_row, per_key = s.fit()
    rest = fixed + per_row * 4 + per_key * 4 * 4097

    def cost(rows, depth):
        return per_row * rows + per_key * chunk_keys(depth, rows)

    for rows, depth in ((shallow, 0), (deep, 3500)):  # the smallest multiple of ROUND reaching the ratio
        assert cost(rows, depth) >= OVERHEAD_RATIO * rest > cost(rows - ROUND, depth)


def test_a_deep_chunk_is_predicted_at_what_its_depth_costs():
    # session 17, 4k prompts: by rows alone a step of 448 rows at depth ~3.5k was predicted at 5.2 s and took 12.2 s
    s = _deepening(ChunkSizer(128, 512), 0.03, 0.0103, 4.5e-6, noise=0.05)
    rows = s.rows(1, 4097, 3500)
    assert rows == 128  # the floor: one decoder costs little next to even the smallest chunk
    fixed, per_row, per_key = s.fit()
    keys = chunk_keys(3500, rows) + 4097
    took = 0.03 + 0.0103 * (rows + 1) + 4.5e-6 * keys
    assert fixed + per_row * (rows + 1) + per_key * keys == pytest.approx(took, rel=0.1)
