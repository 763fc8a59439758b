"""Runtime: owns the model, its KV caches and (later) sessions and residency; generates text."""

import time
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Union

from .config import KVConfig, home as home_dir
from .errors import UserError

Prompt = Union[str, List[dict]]


@dataclass
class Chunk:
    """One streamed piece: the new text (may be empty mid-character) and the token id
    (-1 for the final flush of text held back by the detokenizer)."""

    text: str
    token: int


@dataclass
class Generation:
    """A finished generation: text, token ids and stats (prompt_tokens, reused_tokens, prefill_s,
    ttft_s, decode_tok_s, peak_memory_bytes, generated_tokens, finish_reason)."""

    text: str
    tokens: List[int]
    stats: dict = field(default_factory=dict)


def _check_budget(memory_budget):
    """Bytes (int) or a fraction of physical memory (0 < float <= 1); None means no budget."""
    if memory_budget is None:
        return None
    if isinstance(memory_budget, float) and 0 < memory_budget <= 1:
        import psutil

        return int(memory_budget * psutil.virtual_memory().total)
    if isinstance(memory_budget, int) and memory_budget > 0:
        return memory_budget
    raise UserError(f"memory_budget must be bytes > 0 or a fraction in (0, 1], not {memory_budget!r}")


class Runtime:
    """A loaded model plus its KV configuration; generate() and stream() run one turn each."""

    def __init__(self, model="default", kv: Optional[KVConfig] = None, memory_budget=None, home=None,
                 avoid_regimes: bool = False, draft_model=None):
        from .models import load
        from .phaseswap.attach import attach

        self.kv = kv or KVConfig()
        self.home = home_dir(home)
        self.memory_budget = _check_budget(memory_budget)
        self.avoid_regimes = avoid_regimes
        self.model_spec = model
        self.model, self.tokenizer = load(model, home=self.home)
        self.last_stats: dict = {}
        self.scheduler = None  # batching (scheduler): the Engine, made on first use by batch_engine()
        attach(self, draft_model)  # PhaseSwap: self.phaseswap (residency manager), self.drafter

    # -- tokens -------------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> List[int]:
        """Token ids of a prompt: messages (or a plain string as one user message) through the
        chat template when the tokenizer has one, else the raw text."""
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt):
            messages = prompt
        else:
            raise UserError("prompt must be a string or a list of {'role', 'content'} messages")
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return list(tok.encode(text, add_special_tokens=False))
        text = "\n".join(m.get("content", "") for m in messages)
        return list(tok.encode(text))

    def make_cache(self) -> list:
        """Per-layer KV caches (KVExec) usable by mlx_lm.generate(..., prompt_cache=caches)."""
        from .kvexec import make_cache

        return make_cache(self.model, self.kv, pool=self.prefix_index().pool)

    def prefix_index(self):
        """StateTrans prefix index (shared page pool + page store) of this runtime, made on first use."""
        if getattr(self, "_prefix_index", None) is None:
            from .statetrans.index import PrefixIndex

            self._prefix_index = PrefixIndex.for_runtime(self)
        return self._prefix_index

    def session(self, name: str, **options):
        """Create or resume the named StateTrans session (persisted under JUSTFIT_HOME/sessions)."""
        from .statetrans import Session

        return Session.open(self, name, **options)

    # -- residency (PhaseSwap) ----------------------------------------------------------------
    def residency(self) -> dict:
        """Resident components, their bytes, the current phase and the memory budget."""
        return self.phaseswap.report()

    def tool_phase(self, session=None):
        """`with rt.tool_phase():` releases weights and KV while a tool runs; reloads on the next turn."""
        from .phaseswap.toolphase import tool_phase

        return tool_phase(self, session)

    # -- generation ---------------------------------------------------------------------------
    def stream(self, prompt: Prompt, max_tokens: int = 256, temperature: float = 0.0,
               seed: Optional[int] = None, top_p: float = 1.0) -> Iterator[Chunk]:
        """Yield Chunks as tokens are generated; stats of the turn land in self.last_stats."""
        from .statetrans.reuse import stream_reusing_prefix

        yield from stream_reusing_prefix(self, self.encode(prompt), max_tokens, temperature, seed, top_p)

    def generate(self, prompt: Prompt, max_tokens: int = 256, temperature: float = 0.0,
                 seed: Optional[int] = None, top_p: float = 1.0) -> Generation:
        """Generate a whole reply; same arguments as stream()."""
        chunks = list(self.stream(prompt, max_tokens, temperature, seed, top_p))
        tokens = [c.token for c in chunks if c.token >= 0]
        return Generation("".join(c.text for c in chunks), tokens, dict(self.last_stats))

    def _steer(self, context_tokens: int, max_tokens: int, stats: dict) -> int:
        """With avoid_regimes, the decode budget the device's probe map says is safe (>= max_tokens)."""
        if not self.avoid_regimes:
            return max_tokens
        from .probe.maps import steer_runtime

        reserved, note = steer_runtime(self, context_tokens, max_tokens)
        stats.update(requested_max_tokens=max_tokens, reserved_max_tokens=reserved, steer_note=note)
        return max(reserved, max_tokens)

    def stream_tokens(self, tokens: List[int], cache: list, max_tokens: int = 256,
                      temperature: float = 0.0, seed: Optional[int] = None, top_p: float = 1.0,
                      reused_tokens: int = 0) -> Iterator[Chunk]:
        """Prefill `tokens` not yet in `cache` (all but the first `reused_tokens`) then decode."""
        import mlx.core as mx
        from mlx_lm.sample_utils import make_sampler

        from .phaseswap.attach import turn_steps

        if max_tokens < 1:
            raise UserError(f"max_tokens must be at least 1, not {max_tokens}")
        if not 0 <= reused_tokens < len(tokens):
            raise ValueError("reused_tokens must leave at least one token to prefill")
        if seed is not None:
            mx.random.seed(seed)
        sampler = make_sampler(temp=temperature, top_p=top_p)
        detok = self.tokenizer.detokenizer
        detok.reset()
        eos = set(self.tokenizer.eos_token_ids)
        stats = {"prompt_tokens": len(tokens), "reused_tokens": reused_tokens, "generated_tokens": 0,
                 "finish_reason": "length"}
        self.last_stats = stats
        mx.reset_peak_memory()
        start = time.perf_counter()
        budget = self._steer(len(tokens), max_tokens, stats)
        steps = turn_steps(self, tokens, cache, reused_tokens, budget, sampler, temperature == 0, eos, stats)
        first = None
        for n, (token, _) in enumerate(steps):
            if n >= max_tokens:  # a steered budget reserves more; the user's limit still stops us
                break
            if first is None:
                first = time.perf_counter()
                stats["ttft_s"] = stats["prefill_s"] = first - start
            if token in eos:
                stats["finish_reason"] = "stop"
                break
            stats["generated_tokens"] = n + 1
            detok.add_token(token)
            elapsed = time.perf_counter() - first
            stats["decode_tok_s"] = n / elapsed if n else 0.0
            stats["peak_memory_bytes"] = mx.get_peak_memory()
            yield Chunk(detok.last_segment, token)
        steps.close()  # back to the idle phase now, not when the generator is collected
        detok.finalize()
        stats["peak_memory_bytes"] = mx.get_peak_memory()
        if detok.last_segment:
            yield Chunk(detok.last_segment, -1)

    # -- batching (scheduler) --------------------------------------------------------------------
    def batch_engine(self, kv_budget_bytes: Optional[int] = None, **options):
        """The continuous-batching engine (scheduler.Engine) over this runtime's model and shared page
        pool, made on first use; kv_budget_bytes bounds its KV pages (default: the memory budget less
        the weights). Options (step_tokens, max_batch) apply when it is made."""
        if self.scheduler is None:
            from mlx.utils import tree_flatten

            from .scheduler import Engine

            if kv_budget_bytes is None and self.memory_budget is not None:
                weights = sum(a.nbytes for _, a in tree_flatten(self.model.parameters()))
                kv_budget_bytes = max(1, self.memory_budget - weights)
            self.scheduler = Engine(self.model, self.tokenizer, self.make_cache, index=self.prefix_index(),
                                    kv=self.kv, budget_bytes=kv_budget_bytes, home=self.home, **options)
        return self.scheduler

    def submit(self, prompt, max_tokens: int = 256, **sampling):
        """Queue one request to run batched with others: iterate it for Chunks, `req.cancel()`,
        `req.result()` -> Generation. Sampling options as for generate (temperature, seed, top_p, stop...)."""
        tokens = list(prompt) if _is_token_ids(prompt) else self.encode(prompt)
        return self.batch_engine().submit(tokens, max_tokens, **sampling)

    def generate_batch(self, prompts, max_tokens: int = 256, **sampling) -> List[Generation]:
        """Generate replies to several prompts in one continuous batch; Generations in prompt order."""
        reqs = [self.submit(p, max_tokens, **sampling) for p in prompts]
        return self.batch_engine().run(reqs)

    def submit_async(self, prompt, max_tokens: int = 256, **sampling):
        """asyncio form of submit: `async for chunk in req`, `await req.result()`, `req.cancel()`."""
        from .scheduler import AsyncRequest

        return AsyncRequest(self.submit(prompt, max_tokens, **sampling))


def _is_token_ids(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(t, int) for t in prompt)
