"""Runtime: owns the model, its page pool and prefix index, residency and drafter; runs turns.

Every turn goes tokens -> prefix lookup (statetrans) -> a request of the engine core (justfit/engine)
over a KVExec cache -> pages published for the next prompt. Fronts (chat, sessions, agents, benches, the
server) call `stream`/`generate`/`stream_tokens`; none has a loop of its own.
"""

from typing import Callable, Iterator, List, Optional, Tuple, Union

from .config import KVConfig, home as home_dir
from .errors import UserError
from .engine.sampling import Sampling
from .engine.runner import prefill
from .turns import Chunk, Generation, Turn, TurnStats

Prompt = Union[str, List[dict], List[int]]
Steering = Callable[[int, int], Tuple[int, Optional[str]]]

__all__ = ["Runtime", "Chunk", "Generation", "TurnStats", "Prompt"]


class Runtime:
    """A loaded model plus everything a turn needs; generate() and stream() run one turn each.

    steering: optional decode-budget policy `(context_tokens, max_tokens) -> (reserved, note)`, e.g.
    `justfit.probe.maps.RegimeSteering` built from this device's probe map."""

    def __init__(self, model="default", kv: Optional[KVConfig] = None, memory_budget=None, home=None,
                 steering: Optional[Steering] = None, draft_model=None, drafter: str = "prompt-lookup"):
        from .distributed import shard_model
        from .models import load
        from .phaseswap.attach import build_residency, make_drafter
        from .phaseswap.budget import budget_from_env, parse_budget
        from .statetrans.index import make_index

        self.kv = kv or KVConfig()
        self.home = home_dir(home)
        self.memory_budget = parse_budget(memory_budget) if memory_budget is not None else budget_from_env()
        self.steering = steering
        self.model_spec = model
        self.model, self.tokenizer = load(model, home=self.home)
        self.sharding = shard_model(self.model)  # distributed hook: cuts the model per mlx.launch rank; no-op in one process
        self.phaseswap = build_residency(self.model, self.memory_budget, self.home)
        if self.sharding.world_size > 1:  # the drafting gate times steps per rank: ranks would diverge
            drafter, draft_model = "none", None
        self.drafter, self.gate = make_drafter(self.phaseswap, self.tokenizer, self.home, draft_model, drafter)
        kv_share = self.kv_budget()
        self.index = make_index(self.model, self.tokenizer, self.kv, self.home,
                                **({"memory_cap": kv_share} if kv_share is not None else {}))
        self.last_stats = TurnStats()
        self.engine = None  # the engine core (justfit/engine), made on first use by batch_engine()

    # -- tokens -------------------------------------------------------------------------------
    def encode(self, prompt: Prompt, add_generation_prompt: bool = True) -> List[int]:
        """Token ids of a prompt: raw ids pass through; messages (a string is one user message) go
        through the chat template. The one renderer: chat, sessions and agents all call it."""
        from .models.chat import render_chat

        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not (isinstance(messages, list) and messages
                and all(isinstance(m, dict) and "role" in m for m in messages)):
            raise UserError("prompt must be a string, a non-empty list of {'role', 'content'} messages or token ids")
        return render_chat(self.tokenizer, messages, add_generation_prompt)

    def make_cache(self, resident: bool = True) -> list:
        """Per-layer KV caches (KVExec, on this runtime's page pool) usable by mlx_lm.generate(...,
        prompt_cache=caches). Weights released by a tool phase come back first unless resident=False
        (turns enter their own phases)."""
        from .kvexec import make_cache

        if resident:
            self.ensure_resident()
        return make_cache(self.model, self.kv, pool=self.index.pool)

    def ensure_resident(self):
        """Bring released weights back now: for callers that use `rt.model` outside a turn."""
        self.phaseswap.enter("resident")

    def session(self, name: Optional[str], **options):
        """Create or resume the named StateTrans session (persisted under JUSTFIT_HOME/sessions);
        name=None gives an in-memory session (shares pages the same way, writes nothing)."""
        from .distributed.sessions import open_session
        from .statetrans.session import Session

        if name is None:
            return Session(self, None, persist=False, **options)
        return open_session(self, name, **options)  # distributed hook: checks the world manifest

    # -- residency (PhaseSwap) ----------------------------------------------------------------
    def residency(self) -> dict:
        """Resident components, their bytes, the current phase and the memory budget."""
        return self.phaseswap.report()

    def tool_phase(self, session=None):
        """`with rt.tool_phase():` releases weights and KV while a tool runs; reloads on the next turn."""
        from .phaseswap.toolphase import tool_phase

        return tool_phase(self.phaseswap, self.model, session)

    def register_kv(self, name: str, caches, nbytes: Callable[[], int], release: Callable[[], None],
                    checkpointed: Callable[[], bool]):
        """Make a session's KV a PhaseSwap component: a tool phase calls release() (pages already on disk
        become lazy loaders), phases that run on `caches` lease it, nothing is loaded eagerly."""
        from .phaseswap.components import Component

        self.phaseswap.add_kv(Component(name, "kv", nbytes, load=lambda: None, unload=release, roles=("kv",),
                                        checkpointed=checkpointed), caches)

    def unregister_kv(self, name: str):
        self.phaseswap.remove(name)

    def set_drafter(self, name: str):
        """Switch drafting: 'none' or 'prompt-lookup' (a draft model is given at construction)."""
        from .phaseswap.drafting import Gate, PromptLookup

        if name not in ("none", "prompt-lookup"):
            raise UserError(f"drafter must be 'none' or 'prompt-lookup', not {name!r}")
        self.drafter, self.gate = (PromptLookup() if name == "prompt-lookup" else None), Gate()
        if self.engine is not None:  # a lone batched request drafts with the same drafter
            self.engine.set_drafter(self.drafter, self.gate)

    # -- generation ---------------------------------------------------------------------------
    def stream(self, prompt: Prompt, max_tokens: int = 256, temperature: float = 0.0,
               seed: Optional[int] = None, top_p: float = 1.0, **options) -> Turn:
        """Yield Chunks as tokens are generated, reusing the longest cached prefix of the prompt
        (token-exact). options: top_k, min_p, repetition_penalty, stop, logit_bias, logits_processors,
        constraint, progress. The returned Turn's `stats` are this turn's (also in self.last_stats, the
        turn started last)."""
        stats = TurnStats()
        return Turn(self._stream(prompt, max_tokens, temperature, seed, top_p, stats, options), stats)

    def _stream(self, prompt, max_tokens, temperature, seed, top_p, stats, options) -> Iterator[Chunk]:
        from .statetrans.reuse import reusing_prefix

        tokens = self.encode(prompt)
        progress = options.pop("progress", None)
        sampling = Sampling(temperature=temperature, top_p=top_p, seed=seed, **options)
        with reusing_prefix(self.index, self.make_cache(resident=False), tokens) as (cache, reused, fed):
            yield from self.stream_tokens(tokens, cache, max_tokens, sampling=sampling, reused_tokens=reused,
                                          progress=progress, fed=fed, stats=stats)

    def generate(self, prompt: Prompt, max_tokens: int = 256, temperature: float = 0.0,
                 seed: Optional[int] = None, top_p: float = 1.0, **options) -> Generation:
        """Generate a whole reply; same arguments as stream()."""
        turn = self.stream(prompt, max_tokens, temperature, seed, top_p, **options)
        chunks = list(turn)
        return Generation("".join(c.text for c in chunks), [c.token for c in chunks if c.token >= 0], turn.stats)

    def stream_tokens(self, tokens: List[int], cache: list, max_tokens: int = 256,
                      temperature: float = 0.0, seed: Optional[int] = None, top_p: float = 1.0,
                      reused_tokens: int = 0, sampling: Optional[Sampling] = None,
                      progress: Optional[Callable] = None, fed: Optional[List[int]] = None,
                      stats: Optional[TurnStats] = None, **options) -> Turn:
        """Prefill `tokens` not yet in `cache` (all but the first `reused_tokens`) then decode, as a request
        of the engine core on these caches; `fed` receives the generated ids the cache holds afterwards (the
        end-of-turn id included). The Turn's stats are `stats` when given (the caller's own record), else a
        new TurnStats."""
        sampling = sampling or Sampling(temperature=temperature, top_p=top_p, seed=seed, **options)
        stats = stats if stats is not None else TurnStats()
        self.last_stats = stats
        return Turn(self._turn(tokens, cache, max_tokens, reused_tokens, sampling, stats, progress, fed), stats)

    def submit_turn(self, tokens: List[int], cache: list, max_tokens: int, reused_tokens: int, stats: TurnStats,
                    progress: Optional[Callable] = None, on_done: Optional[Callable] = None,
                    sampling: Optional[Sampling] = None, **options):
        """Queue a turn on caller-owned caches holding tokens[:reused_tokens] (a session's, a prefix lookup's)
        as a request of the engine core; on_done(request) runs once it is finished and the caches hold the
        whole turn; sampling: a Sampling, or its fields as options. Iterate the returned Request for Chunks
        (that steps the engine), or step it with others."""
        sampling = sampling if sampling is not None else Sampling(**options)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise UserError(f"max_tokens must be an integer >= 1, not {max_tokens!r}")
        if not tokens:
            raise UserError("the prompt renders to no tokens")
        if self.steering is not None:  # a decode-budget policy (regime steering) reserves, the caller still limits
            reserved, note = self.steering(len(tokens), max_tokens)
            stats.requested_max_tokens, stats.reserved_max_tokens, stats.steer_note = max_tokens, reserved, note
        return self.batch_engine().submit(tokens, max_tokens, caches=cache, reused=reused_tokens, progress=progress,
                                          stats=stats, sampling=sampling, on_done=on_done)

    def _turn(self, tokens, cache, max_tokens, reused, sampling, stats, progress, fed) -> Iterator[Chunk]:
        req = self.submit_turn(tokens, cache, max_tokens, reused, stats, progress, sampling=sampling)
        try:
            for chunk in req:  # (not `yield from`: closing this turn must not close the request's text)
                yield chunk
        finally:
            if not req.done:
                req.cancel()  # the caller stopped early: what was computed stays in the cache
            if fed is not None:
                fed.extend(req.held())

    def prefill(self, tokens: List[int], cache: list, progress: Optional[Callable] = None,
                after_chunk: Optional[Callable] = None, step: Optional[int] = None) -> float:
        """Put `tokens` (the ones after what `cache` holds) into the cache, weights resident; no decode."""
        kwargs = {"step": step} if step else {}
        reload_s = prefill(self.model, cache, tokens, self.phaseswap, progress, after_chunk=after_chunk, **kwargs)
        self.phaseswap.enter("idle")
        return reload_s

    # -- the engine core (batching) ----------------------------------------------------------------
    def kv_budget(self) -> Optional[int]:
        """The KV share of the memory budget: the budget less every weight PhaseSwap holds for this runtime
        (the model's, a draft model's, adapters'), resident or released (they come back). The engine's pages
        and the prefix index's cached pages both live under it; None without a memory budget (the index then
        keeps its own cap)."""
        if self.memory_budget is None:
            return None
        weights = sum(c.size() for c in self.phaseswap.components.values() if c.kind != "kv")
        return max(1, self.memory_budget - weights)

    def batch_engine(self, kv_budget_bytes: Optional[int] = None, **options):
        """The continuous-batching engine core (engine.Engine) over this runtime's model and page pool,
        made on first use; kv_budget_bytes bounds its KV pages (default: kv_budget()). Options (step_tokens, max_batch) apply when it is made. A request running alone decodes
        speculatively with this runtime's drafter; several run as plain batched decodes."""
        if self.engine is None:
            from .engine import Engine

            if kv_budget_bytes is None:
                kv_budget_bytes = self.kv_budget()
            self.engine = Engine(self.model, self.tokenizer, self.make_cache, index=self.index, kv=self.kv,
                                    budget_bytes=kv_budget_bytes, residency=self.phaseswap, drafter=self.drafter,
                                    gate=self.gate, **options)
            self.phaseswap.meter_kv(self.engine.kv.used_bytes, self.engine.kv.reclaim)  # one KV figure, one budget
        return self.engine

    def submit(self, prompt: Prompt, max_tokens: int = 256, **sampling):
        """Queue one request to run batched with others: iterate it for Chunks, `req.cancel()`,
        `req.result()` -> Generation. Sampling options as for generate (temperature, seed, top_p, stop...)."""
        return self.batch_engine().submit(self.encode(prompt), max_tokens, **sampling)

    def generate_batch(self, prompts: List[Prompt], max_tokens: int = 256, **sampling) -> List[Generation]:
        """Generate replies to several prompts in one continuous batch; Generations in prompt order."""
        reqs = [self.submit(p, max_tokens, **sampling) for p in prompts]
        return self.batch_engine().run(reqs)

    def submit_async(self, prompt: Prompt, max_tokens: int = 256, **sampling):
        """asyncio form of submit: `async for chunk in req`, `await req.result()`, `req.cancel()`."""
        from .engine import AsyncRequest

        return AsyncRequest(self.submit(prompt, max_tokens, **sampling))
