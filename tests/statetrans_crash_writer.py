"""Crash-test writer (run as a subprocess, killed with SIGKILL at random points): commits versions
k = last+1, last+2, ... of a session "crash" through StateTrans' own commit path (pages, then manifest,
under the store lock). Version k has (k+1)*PAGES_PER_TURN pages; page i is filled with the value i.
Prints "committed k" after each commit. No MLX: numpy pages, so the process starts fast."""

import sys
from pathlib import Path

import numpy as np

from justfit.statetrans.checkpoint import commit
from justfit.statetrans.hashing import block_hashes
from justfit.statetrans.manifest import Manifest, read_manifest
from justfit.statetrans.store import PageStore

P, H, D, LAYERS, PAGES_PER_TURN = 32, 4, 256, 4, 2
SALT = "00" * 32
KV = {"name": "fp16", "page_size": P}


def page(i: int):
    """Deterministic tensors of page i (~1 MB: big enough that kills land inside writes)."""
    x = np.full((H, P, D), float(i), dtype=np.float32)
    t = {f"{l}.{kv}.0": x for l in range(LAYERS) for kv in "kv"}
    return t, {"layers": str(LAYERS), "kinds": ",".join(["fp"] * LAYERS)}


def tokens(k: int):
    return [(j * 7 + 3) % 1000 for j in range((k + 1) * PAGES_PER_TURN * P + 5)]


def store_of(home: Path) -> PageStore:
    return PageStore(home / "store" / "m", home / "store" / "lock")


def main(home: Path, name: str = "crash", upto: int = 10 ** 9):
    store = store_of(home)
    m = read_manifest(home, name)
    k = -1 if m is None else int(m.messages[-1]["content"].split()[-1])
    sums = {}
    while k < upto:
        k += 1
        toks = tokens(k)
        hs = block_hashes(toks, P, SALT)[: (k + 1) * PAGES_PER_TURN]
        new = [(h, *page(i)) for i, h in enumerate(hs) if not store.has(h)]
        msgs = [{"role": "user", "content": f"turn {j}", "end": 0} for j in range(k + 1)]
        man = Manifest(name, "m", "t", KV, toks, [{"hash": h, "sha256": None} for h in hs], msgs)
        commit(store, home, man, new, sums)
        print(f"committed {k}", flush=True)


def zygote(home: Path):
    """Fork one writer per line read on stdin (imports paid once); print its pid, then 'exited' when
    it is gone. The test kills the writer by that pid."""
    import os

    for _ in sys.stdin:
        pid = os.fork()
        if pid == 0:
            try:
                main(home)
            finally:
                os._exit(0)
        print(f"pid {pid}", flush=True)
        os.waitpid(pid, 0)
        print("exited", flush=True)


if __name__ == "__main__":
    if sys.argv[2:3] == ["--zygote"]:
        zygote(Path(sys.argv[1]))
        sys.exit(0)
    main(Path(sys.argv[1]), *(sys.argv[2:3]), *(int(a) for a in sys.argv[3:4]))
