"""Random page pools in both formats at small shapes, for the kernel tests (and KVExec's)."""

import mlx.core as mx

from . import reference as ref

NO_GXX = "g++ not found: the Metal emulator compiles kernels with g++"
PAGE = 16


def signs(d, seed):
    """±1 rotation signs of length d."""
    return mx.where(mx.random.uniform(shape=(d,), key=mx.random.key(seed)) < 0.5, -1.0, 1.0)


def codebook(seed=7):
    """16 sorted levels, roughly the spread of a rotated unit-vector coordinate at small D."""
    return mx.sort(mx.random.normal((16,), key=mx.random.key(seed)) * 0.12)


def case(fmt="affine", dtype=mx.float16, d=64, h=1, hq=3, nq=1, group=32, n_pool=6,
         table=(4, 0, 5, 2), q_len=None, recent=3, seed=0, page=PAGE, key_group=32):
    """(q, k_pages, v_pages, page_table, q_len, k_recent, v_recent, kwargs) for paged attention.

    fmt "channel": channel keys in token groups of key_group (page a multiple of it, at least 32:
    mx.quantize's smallest group) with affine values in groups of `group`. q_len defaults to three
    full pages and 5 tokens of the fourth.
    """
    key = mx.random.key(seed)
    ks = mx.random.split(key, 5)
    kx = mx.random.normal((n_pool, h, page, d), key=ks[0]).astype(dtype)
    vx = mx.random.normal((n_pool, h, page, d), key=ks[1]).astype(dtype)
    kw = {"scale": d ** -0.5, "group_size": group, "rotation": None}
    if fmt == "affine":
        kp, vp = ref.seal_affine(kx, group, 4), ref.seal_affine(vx, group, 4)
    elif fmt == "channel":
        kp, vp = ref.seal_channel(kx, key_group, 4), ref.seal_affine(vx, group, 4)
        kw.update(key_format="channel", key_group=key_group)
    else:
        rot = (codebook(), signs(d, seed + 1), signs(d, seed + 2))
        kp, vp = ref.seal_rotated(kx, rot[1], rot[0]), ref.seal_rotated(vx, rot[2], rot[0])
        kw["rotation"] = rot
    q = mx.random.normal((hq, nq, d), key=ks[2]).astype(dtype)
    kr = mx.random.normal((h, recent, d), key=ks[3]).astype(dtype)
    vr = mx.random.normal((h, recent, d), key=ks[4]).astype(dtype)
    q_len = 3 * page + 5 if q_len is None else q_len
    return q, kp, vp, mx.array(list(table), dtype=mx.int32), q_len, kr, vr, kw
