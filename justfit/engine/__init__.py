"""The token engine: requests, the one copy of sampling, scheduling policy, the runner, the KV manager and
the core loop (in the split of vLLM's v1 engine, in mlx-lm's small-file style).

    request.py    a Request owns its ids, progress, status, Chooser, detokenizer and TurnStats
    sampling.py   Sampling, Chooser (processors, grammar, forced tokens, seeds), StopText
    scheduler.py  policy only: admission, the step plan, preemption (no MLX)
    kv.py         the KV manager: caches attached and released, the running byte count, speed copies
    runner.py     every model call that produces tokens: prefill, lone and batched passes, speculative verify
    core.py       the step loop (Engine), synchronous or on its one worker thread
"""

from .core import AsyncRequest, Engine
from .request import Request
from .sampling import Chooser, Sampling, StopText

__all__ = ["AsyncRequest", "Chooser", "Engine", "Request", "Sampling", "StopText"]
