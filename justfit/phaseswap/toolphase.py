"""Tool phase: while the agent waits on a tool, give the model's memory back to the OS.

`with tool_phase(rt, session):` checkpoints what is not on disk (`session.checkpoint()` when a
session is given), unloads every weight and KV component (references dropped, `mx.clear_cache()`),
and on exit asks the OS to prefetch the weight files (posix_fadvise WILLNEED), so the next turn's
`Residency.enter("prefill")` reloads them just in time from the page cache. Reloaded tensors are
bit-identical, so outputs after a tool phase equal those of a run that never released anything.

StateTrans sessions delegate: `Session.tool_phase()` returns `rt.tool_phase(self)`; the next
`generate` resumes automatically. A session registers its KV as a component (kind "kv", checkpointed)
so the tool phase releases its pages after the checkpoint; they restore lazily from the store.
"""

import os
from contextlib import contextmanager


def suspend(residency, session=None) -> int:
    """Checkpoint (if a session is given) then release weights and KV; bytes released."""
    if session is not None:
        session.checkpoint()
    residency.enter("tool")
    return residency.release()


def prefetch(model):
    """Hint the OS to read the weight files back into its page cache (non-blocking)."""
    folder = getattr(model, "justfit_path", None)
    if not folder or not hasattr(os, "posix_fadvise"):
        return
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)


@contextmanager
def tool_phase(residency, model, session=None, prefetch_on_exit: bool = True):
    """Release memory for the duration of a tool call; reload happens on the next generate."""
    released = suspend(residency, session)
    try:
        yield released
    finally:
        residency.enter("idle")
        if prefetch_on_exit:
            prefetch(model)
