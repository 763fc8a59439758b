"""Agent: a tool-using loop on a JustFit Runtime whose steps only ever prefill new tokens."""

import re
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional

import justfit
from justfit import TurnStats
from justfit.grammar import Constraint, choice_name, lark_grammar
from justfit.toolcalls import FINISH_TEXT, FINISH_TOOL, describe, detect

from .state import AgentState
from .tools import Tool, as_tool, as_tools, call_tool, truncate

DEFAULT_SYSTEM = "You are a helpful assistant. Use the tools to find facts; answer briefly."


def final_answer(answer: str) -> str:
    """Give the final answer to the task and stop.

    Args:
        answer: the complete answer for the user
    """
    return answer


@dataclass
class ToolCall:
    name: str
    arguments: dict
    result: str = ""
    tool_s: float = 0.0


@dataclass
class Step:
    """One model turn: its raw text, the call it made (if any) and its token/timing stats."""

    index: int
    text: str
    call: Optional[ToolCall] = None
    stats: Optional[TurnStats] = None


@dataclass
class Event:
    """What stream() yields: kind is 'call', 'result', 'answer' or 'done'."""

    kind: str
    step: int
    text: str = ""
    call: Optional[ToolCall] = None
    stats: dict = field(default_factory=dict)
    result: Optional["Result"] = None


@dataclass
class Result:
    answer: str
    steps: List[Step]
    stopped: str  # 'answer' | 'max_steps' | 'stop' | 'repeat' (same call twice) | 'length' | 'tool_error'
    #              (final_answer right after a failed tool call)
    stats: dict = field(default_factory=dict)

    @property
    def tool_calls(self) -> List[ToolCall]:
        return [s.call for s in self.steps if s.call is not None]

    def transcript(self) -> str:
        """Readable account of the run: one block per step with its token counts."""
        lines = []
        for s in self.steps:
            st = s.stats or TurnStats()
            lines.append(f"--- step {s.index}  prompt {st.prompt_tokens} | reused {st.reused_tokens} "
                         f"| prefilled {st.prefilled_tokens} | {st.turn_s:.2f} s")
            if s.call is not None:
                lines.append(f"call {s.call.name}({_args(s.call.arguments)})")
                lines.append("  -> " + s.call.result.replace("\n", "\n     "))
            else:
                lines.append(s.text)
        if self.stopped == "answer":
            lines.append(f"=== answer: {self.answer}")
        else:  # never shown as if it were an answer: say the run did not give one, and why
            last = f"; last tool result: {self.answer}" if self.answer else ""
            lines.append(f"=== no final answer (stopped: {self.stopped}){last}")
        return "\n".join(lines)

    def __str__(self):
        return self.transcript()


def failed(call: Optional[ToolCall]) -> bool:
    """The call's result reports a failure: the tool raised (call_tool's 'error: ...') or the process it
    ran exited non-zero (the sandbox's closing '[exit code N]')."""
    result = (call.result or "") if call is not None else ""
    return result.startswith("error: ") or re.search(r"\[exit code -?\d+\]\s*$", result) is not None


def _args(arguments: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in arguments.items())


class Agent:
    """Agent(runtime, system=..., tools=[fn, ...], session="name"); run(task) -> Result.

    tool_choice: "auto" (call a tool or answer in text), "required" (every step calls a tool; the
    first step of a run a real one, later steps may call the added final_answer), "none", or
    {"name": tool} (that tool first, then as "required"). max_string caps each string argument.
    """

    def __init__(self, runtime, system: str = DEFAULT_SYSTEM, tools=(), session: Optional[str] = None,
                 tool_choice="auto", max_steps: int = 8, max_tokens: int = 512, temperature: float = 0.0,
                 top_p: float = 1.0, seed: Optional[int] = None, result_tokens: int = 384,
                 max_string: int = 160, stop: Optional[Callable[[Step], bool]] = None,
                 subagents: bool = False, stop_on_repeat: bool = True, _state=None, _messages=None, _prompt_tools=None):
        choice_name(tool_choice)  # validates
        self.rt, self.system, self.tool_choice = runtime, system, tool_choice
        self.max_steps, self.max_tokens, self.temperature, self.top_p = max_steps, max_tokens, temperature, top_p
        self.seed, self.result_tokens, self.max_string, self.stop = seed, result_tokens, max_string, stop
        self.stop_on_repeat = stop_on_repeat
        self.syntax = detect(runtime.tokenizer)
        self.tools = as_tools(tools)
        if tool_choice not in ("auto", "none") and "final_answer" not in self.tools:
            self.tools["final_answer"] = as_tool(final_answer)
        if subagents:
            self.tools["spawn_agent"] = as_tool(self._spawn_tool, "spawn_agent")
        self.prompt_tools: List[Tool] = _prompt_tools or list(self.tools.values())
        self.eos = set(getattr(runtime.tokenizer, "eos_token_ids", None) or [runtime.tokenizer.eos_token_id])
        self.n_vocab = _vocab_size(runtime.model)
        self.state = _state or AgentState(runtime, session)
        self.messages = _messages
        if self.messages is None:
            self.messages = (self.state.resume() if session else None) or []
            self._set_system()
        self.history: List[Step] = []

    def _set_system(self) -> None:
        if self.messages and self.messages[0]["role"] == "system":
            self.messages[0] = {"role": "system", "content": self.system}
        else:
            self.messages.insert(0, {"role": "system", "content": self.system})

    # -- the loop ------------------------------------------------------------------------------
    def run(self, task: str) -> Result:
        """Run the task to a final answer (or a stop condition) and return the Result."""
        result = None
        for event in self.stream(task):
            result = event.result if event.kind == "done" else result
        return result

    def stream(self, task: str) -> Iterator[Event]:
        """Run the task, yielding an Event per tool call, tool result and final answer."""
        loop, reply = self._loop(task), None
        while True:
            try:
                item = loop.send(reply)
            except StopIteration:
                return
            if isinstance(item, Event):
                reply = None
                yield item
            else:  # a model turn: decode it now on this agent's session
                reply = (list(self.state.step(*item)), self.state.stats)

    def _loop(self, task: str):
        """The agent loop as a coroutine: yields Events, and the arguments of each model turn, to which
        the driver sends back (generated ids, TurnStats); stream() decodes turns one by one, fan_out()
        batches several agents' turns."""
        self.messages.append({"role": "user", "content": task})
        steps: List[Step] = []
        answer, stopped = "", "max_steps"
        for i in range(self.max_steps):
            choice = self.tool_choice if i == 0 or not isinstance(self.tool_choice, dict) else "required"
            step = yield from self._model_step(len(self.history) + len(steps), choice, first=i == 0)
            steps.append(step)
            if step.call is None:
                answer, stopped = step.text.strip(), "answer" if step.stats.finish_reason != "length" else "length"
                yield Event("answer", step.index, step.text, stats=step.stats)
                break
            yield Event("call", step.index, step.text, step.call, step.stats)
            self._run_tool(step.call)
            yield Event("result", step.index, step.call.result, step.call, step.stats)
            if step.call.name == "final_answer":
                prev = steps[-2].call if len(steps) > 1 else None
                # an answer right after a failed call (the model gave up on the error) is not a finished task
                answer, stopped = step.call.arguments.get("answer", ""), "tool_error" if failed(prev) else "answer"
                break
            if self.stop is not None and self.stop(step):
                stopped = "stop"
                break
            prev = steps[-2].call if len(steps) > 1 else None
            if self.stop_on_repeat and prev is not None and (prev.name, prev.arguments) == (step.call.name, step.call.arguments):
                answer, stopped = step.call.result, "repeat"  # same call again: its result is the answer
                break
        self.history += steps
        if self.state.name:
            self.state.checkpoint(self.messages)
        result = Result(answer, steps, stopped, _totals(steps))
        yield Event("done", steps[-1].index if steps else 0, answer, stats=result.stats, result=result)

    def _model_step(self, index: int, choice, first: bool = False):
        """Render the conversation, extend the state by the new tokens, have the driver decode one reply
        (yields the turn's arguments, receives (ids, stats)); returns the Step."""
        finish = FINISH_TOOL if "final_answer" in self.tools else FINISH_TEXT
        self.state.sync(self.syntax.render(self.rt.tokenizer, self.messages, self.prompt_tools, finish))
        allowed = list(self.tools.values())
        if choice == "required" and first and len(allowed) > 1:  # "required": use a real tool before answering
            allowed = [t for t in allowed if t.name != "final_answer"]
        grammar = lark_grammar(allowed, self.syntax, choice, self.max_string)
        constraint = Constraint(self.rt.tokenizer, self.n_vocab, grammar) if grammar else None
        seed = None if self.seed is None else self.seed + index
        tokens, stats = yield (self.max_tokens, self.eos, self.temperature, self.top_p, constraint, seed)
        body = [t for t in tokens if t not in self.eos]
        text = self.rt.tokenizer.decode(body)
        self.messages.append({"role": "assistant", "content": text})
        parsed = self.syntax.parse(text) if self.tools else None
        call = None
        if parsed is not None and parsed["name"] in self.tools:
            call = ToolCall(parsed["name"], parsed["arguments"])
        return Step(index, text, call, stats)

    def _run_tool(self, call: ToolCall) -> None:
        """Run the call inside a tool phase; the (truncated) result joins the conversation."""
        t = self.tools[call.name]
        start = time.perf_counter()
        if call.name in ("final_answer", "spawn_agent"):  # these need the model or end the loop
            out = call_tool(t, call.arguments)
        else:
            with self.state.tool_phase():
                out = call_tool(t, call.arguments)
        call.tool_s = time.perf_counter() - start
        call.result = truncate(out, self.rt.tokenizer, self.result_tokens)
        self.messages.append(self.syntax.tool_message(call.name, call.result))

    # -- sub-agents ------------------------------------------------------------------------------
    def fork(self, tools=None, session: Optional[str] = None, **overrides) -> "Agent":
        """A child agent that continues from this conversation; its cache starts as a copy of ours."""
        self._catch_up()
        opts = dict(system=self.system, tool_choice=self.tool_choice, max_steps=self.max_steps,
                    max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                    seed=self.seed, result_tokens=self.result_tokens, max_string=self.max_string)
        opts.update(overrides)
        child_tools = [t for n, t in self.tools.items() if n != "spawn_agent"] if tools is None else tools
        return Agent(self.rt, tools=child_tools, _state=self.state.fork(session),
                     _messages=[dict(m) for m in self.messages], _prompt_tools=self.prompt_tools, **opts)

    def _catch_up(self) -> None:
        """Prefill pending history (tool results) so forks share it instead of recomputing it."""
        finish = FINISH_TOOL if "final_answer" in self.tools else FINISH_TEXT
        text = self.syntax.render(self.rt.tokenizer, self.messages, self.prompt_tools, finish, generation_prompt=False)
        self.state.sync(text)
        self.state.prefill_pending()

    def spawn(self, task: str, tools=None, record: bool = True, **overrides) -> Result:
        """Fork, run `task` in the child, and (record=True) hand its answer back to this agent's
        conversation as the result of a spawn_agent call."""
        child = self.fork(tools=tools, **overrides)
        try:
            result = child.run(self._subtask_text(task, child))
        finally:
            child.close()
        if record:
            self._record("spawn_agent", {"task": task}, _handback(result))
        return result

    def fan_out(self, tasks: List[str], tools=None, **overrides) -> List[Result]:
        """Several sub-agents from the same fork point run as one batch: their model turns are requests on
        the runtime's batching engine (rt.submit), decoded together, tools run between turns; each child
        gives its pages back when all are done. Greedy results equal spawning them one after another."""
        children = [self.fork(tools=tools, **overrides) for _ in tasks]
        try:
            results = _run_together([(c, c._loop(self._subtask_text(t, c))) for c, t in zip(children, tasks)])
        finally:
            for c in children:
                c.close()
        for task, r in zip(tasks, results):
            self._record("spawn_agent", {"task": task}, _handback(r))
        return results

    def _subtask_text(self, task: str, child: "Agent") -> str:
        extra = [t for t in child.tools.values() if t not in self.prompt_tools]
        note = f"\nFor this sub-task you may also use these tools:\n{describe(extra)}" if extra else ""
        return f"Sub-task: {task}{note}"

    def _record(self, name: str, arguments: dict, result: str) -> None:
        self.messages.append({"role": "assistant", "content": self.syntax.call_text(name, arguments)})
        self.messages.append(self.syntax.tool_message(name, truncate(result, self.rt.tokenizer, self.result_tokens)))
        if self.state.name:
            self.state.checkpoint(self.messages)

    def _spawn_tool(self, task: str) -> str:
        """Hand a self-contained sub-task to a sub-agent and get its answer back.

        Args:
            task: what the sub-agent should find out or do
        """
        return _handback(self.spawn(task, record=False))

    def close(self) -> None:
        """Give this agent's pages back to the runtime's pool (a named agent is checkpointed first)."""
        self.state.close()

    def transcript(self) -> str:
        """Transcript of every step this agent has run so far."""
        return Result("", self.history, "").transcript()


def _run_together(loops) -> List[Result]:
    """Drive several agents' loops at once: each model turn becomes a request on the batching engine;
    iterating any unfinished request steps the engine for all of them."""
    results: List[Optional[Result]] = [None] * len(loops)
    replies, requests, live = [None] * len(loops), {}, set(range(len(loops)))
    try:
        while live:
            for i in sorted(live - set(requests)):
                agent, loop = loops[i]
                try:
                    item = loop.send(replies[i])
                    while isinstance(item, Event):
                        results[i] = item.result if item.kind == "done" else results[i]
                        item = loop.send(None)
                except StopIteration:
                    live.discard(i)
                    continue
                requests[i] = agent.state.submit(*item)
            if requests:
                next(iter(next(r for r in requests.values() if not r.done)), None)  # one engine step or more
            for i, req in list(requests.items()):
                if req.done:
                    replies[i] = loops[i][0].state.reply(req)
                    del requests[i]
    finally:
        for req in requests.values():  # an error in one sub-agent: the others' turns stop, pages freed
            req.cancel()
    return results


def _handback(result: Result) -> str:
    """What a sub-agent returns to its parent: its answer, or why it has none and what it last saw."""
    if result.answer:
        return result.answer
    last = result.tool_calls[-1].result if result.tool_calls else ""
    return f"[sub-agent stopped ({result.stopped}) without an answer; last tool result: {last}]"


def _totals(steps: List[Step]) -> dict:
    keys = ("prompt_tokens", "reused_tokens", "prefilled_tokens", "generated_tokens", "turn_s")
    tot = {k: sum(getattr(s.stats, k) for s in steps if s.stats is not None) for k in keys}
    tot["steps"] = len(steps)
    tot["tool_s"] = sum(s.call.tool_s for s in steps if s.call is not None)
    return tot


def _vocab_size(model) -> int:
    n = justfit.vocab_size(model)
    if not n:
        raise justfit.UserError(f"cannot tell the vocabulary size of {type(model).__name__}")
    return int(n)
