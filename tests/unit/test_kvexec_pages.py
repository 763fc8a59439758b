"""Page pool: atomic reservation across layers, refcounts, fork with copy-on-write, listing and lazy restore."""

import mlx.core as mx
import pytest

from justfit.config import KVConfig
from justfit.errors import MemoryBudgetError
from justfit.kvexec import PagePool, Sequence, attention
from justfit.kvexec.cache import PagedKVCache
from justfit.kvexec.pages import QUANT, Page


def _layers(n_layers=3, kv=KVConfig(float_pages=0, quantized_kv_start=0, bits=4, page_size=32), max_pages=None):
    seq = Sequence(PagePool(n_layers, kv.page_size, max_pages))
    return seq, [PagedKVCache(seq, i, kv) for i in range(n_layers)]


def _append(caches, n, seed=0):
    k = mx.random.normal((1, 2, n, 64), key=mx.random.key(seed))
    for c in caches:
        c.update_and_fetch(k, -k)


def test_reserve_is_atomic_and_rolls_back():
    seq, caches = _layers(max_pages=4)
    _append(caches, 100)  # 4 pages of 32
    before = (list(seq.table), dict(seq.pool.refs), [c.offset for c in caches])
    with pytest.raises(MemoryBudgetError):
        _append(caches, 40)  # would need 2 more pages: nothing may change in any layer
    assert (list(seq.table), dict(seq.pool.refs), [c.offset for c in caches]) == before
    _append(caches, 28)  # still fits in the 4th page
    assert [c.offset for c in caches] == [128] * 3


def test_pages_seal_quantized_and_window_stays_full_precision():
    seq, caches = _layers(kv=KVConfig(float_pages=0, bits=4, page_size=32, quantized_kv_start=40))
    _append(caches, 100)
    kinds = [p.kind for _, _, p in caches[1].pages()]
    assert kinds == ["fp", "fp", QUANT, "open"]  # pages starting before 40 stay full precision
    assert caches[1].pages()[-1][1] == 4  # 4 valid tokens in the page being filled


def test_trim_frees_pages_only_when_all_layers_trimmed():
    seq, caches = _layers()
    _append(caches, 100)
    caches[0].trim(60)
    assert len(seq.table) == 4
    for c in caches[1:]:
        c.trim(60)
    assert len(seq.table) == 2 and len(seq.pool.refs) == 2 and caches[0].offset == 40
    _append(caches, 30, seed=1)  # reopens the sealed second page and refills it
    assert [c.offset for c in caches] == [70] * 3 and len(seq.table) == 3


def test_fork_shares_pages_and_copies_on_write():
    seq, caches = _layers()
    _append(caches, 80)
    from justfit.kvexec import fork_caches

    child = fork_caches(caches)
    assert all(seq.pool.refs[p] == 2 for p in seq.table)
    q = mx.random.normal((1, 4, 1, 64))
    before = attention.paged_attention(q, caches[2], 0.125)
    _append(child, 20, seed=5)  # writes into the shared partial page: must copy it first
    assert child[0].seq.table[:2] == seq.table[:2]  # sealed pages still shared
    assert child[0].seq.table[2] != seq.table[2]
    after = attention.paged_attention(q, caches[2], 0.125)
    assert mx.array_equal(before, after)  # the parent did not see the child's tokens
    child[0].seq.release()
    assert all(seq.pool.refs[p] == 1 for p in seq.table)


def test_sealed_pages_listing_and_lazy_restore():
    seq, caches = _layers()
    _append(caches, 70)
    sealed = seq.sealed_pages()
    assert [i for i, _, _ in sealed] == [0, 1]
    saved = [[Page.from_tensors(p.kind, p.tensors()) for p in pages] for _, _, pages in sealed]

    seq2, restored = _layers()
    calls = []

    def loader(page, layer):
        def load():
            calls.append(layer)
            return page.k, page.v
        return load

    for pages in saved:
        seq2.append_restored([p.kind for p in pages], [loader(p, i) for i, p in enumerate(pages)])
    assert calls == [] and restored[0].offset == 64  # nothing loaded yet
    q = mx.random.normal((1, 4, 1, 64))
    _append(restored, 6)
    k_ref, _ = caches[0].dense_kv()
    k_new, _ = restored[0].dense_kv()
    assert mx.allclose(k_ref[:, :, :64], k_new[:, :, :64])
    assert 0 in calls
    assert attention.paged_attention(q, restored[1], 0.125).shape == (1, 4, 1, 64)


def test_copy_on_write_of_a_lazily_restored_page_loads_it_once():
    """A shared, restored page copied before its first write must not run its loader twice (the loader
    of a page file closes the file after each layer ran once; a second run read a closed file in CI)."""
    seq, caches = _layers()
    _append(caches, 40)  # one sealed page and an open one of 8 tokens
    pages = [caches[i].seq.pool.get(i, seq.table[1]) for i in range(3)]
    calls = []

    def loader(page, layer):
        def load():
            calls.append(layer)
            return page.k, page.v
        return load

    seq2 = Sequence(seq.pool)
    seq2.append_restored([p.kind for p in pages], [loader(p, i) for i, p in enumerate(pages)], n_tokens=8)
    other = seq2.fork()  # now shared: the first write copies it
    pid = seq2.writable(0)
    assert pid != other.table[0] and sorted(calls) == [0, 1, 2]
    for layer in range(3):
        assert seq.pool.get(layer, pid).k is seq.pool.get(layer, other.table[0]).k
    seq2.pool.get(0, other.table[0]).parts()
    assert sorted(calls) == [0, 1, 2]  # the original record was loaded by the copy, not again


def test_nbytes_counts_pages_and_quantization_shrinks_them():
    _, fp = _layers(kv=KVConfig(bits=16, page_size=32))
    _, q4 = _layers(kv=KVConfig(float_pages=0, quantized_kv_start=0, bits=4, page_size=32))
    _append(fp, 256)
    _append(q4, 256)
    assert fp[0].nbytes == 2 * 256 * 2 * 64 * 4
    assert q4[0].nbytes < 0.2 * fp[0].nbytes
