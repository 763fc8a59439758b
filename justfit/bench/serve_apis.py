"""The agent trace of `justfit bench serve` spoken in each API an agent uses: OpenAI chat completions, OpenAI
Responses and Anthropic Messages. Each function streams one reply and returns the same record: TTFT,
inter-token gaps, completion tokens, the prompt's tokens and how many of them the server reported cached."""

import json
import time
from typing import List

APIS = ("chat", "responses", "messages")
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}


def body(api: str, model: str, messages: List[dict], max_tokens: int, key: str) -> dict:
    """The request for `messages` (system first, then user/assistant turns) in `api`'s own shape."""
    system = [m["content"] for m in messages if m["role"] == "system"]
    turns = [m for m in messages if m["role"] != "system"]
    if api == "chat":
        return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}, "prompt_cache_key": key, "prompt_cache_retention": "24h"}
    if api == "responses":
        items = [{"type": "message", "role": m["role"], "content": m["content"]} for m in turns]
        return {"model": model, "instructions": "\n".join(system), "input": items, "max_output_tokens": max_tokens,
                "temperature": 0.0, "stream": True, "store": False, "prompt_cache_key": key,
                "prompt_cache_retention": "24h"}
    return {"model": model, "system": "\n".join(system), "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "messages": [{"role": m["role"], "content": m["content"]} for m in turns], "metadata": {"user_id": key}}


class Reading:
    """What one streamed reply showed: when its pieces came, and its usage."""

    def __init__(self, start: float):
        self.start, self.first, self.last = start, None, None
        self.gaps: List[float] = []
        self.pieces = 0
        self.completion, self.prompt, self.cached = None, None, None

    def piece(self):
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        else:
            self.gaps.append(now - self.last)
        self.last, self.pieces = now, self.pieces + 1

    def event(self, api: str, data: dict):
        """One parsed SSE data object of `api`'s stream."""
        if api == "chat":
            delta = (data.get("choices") or [{}])[0].get("delta") or {}
            if delta.get("content") or delta.get("tool_calls"):
                self.piece()
            usage = data.get("usage")
            if usage:
                self.completion, self.prompt = usage.get("completion_tokens"), usage.get("prompt_tokens")
                self.cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        elif api == "responses":
            kind = data.get("type", "")
            if kind in ("response.output_text.delta", "response.function_call_arguments.delta") and data.get("delta"):
                self.piece()
            if kind in ("response.completed", "response.incomplete"):  # incomplete: cut at max_output_tokens
                usage = (data.get("response") or {}).get("usage") or {}
                self.completion, self.prompt = usage.get("output_tokens"), usage.get("input_tokens")
                self.cached = (usage.get("input_tokens_details") or {}).get("cached_tokens")
        else:
            kind = data.get("type", "")
            if kind == "content_block_delta":
                d = data.get("delta") or {}
                if d.get("text") or d.get("partial_json"):
                    self.piece()
            elif kind == "message_start":
                usage = (data.get("message") or {}).get("usage") or {}
                read, made = usage.get("cache_read_input_tokens") or 0, usage.get("cache_creation_input_tokens") or 0
                self.prompt, self.cached = (usage.get("input_tokens") or 0) + read + made, read
            elif kind == "message_delta":  # its usage is the final count (cache reads known only once it ran)
                usage = data.get("usage") or {}
                self.completion = usage.get("output_tokens", self.completion)
                if "cache_read_input_tokens" in usage:
                    read, made = usage["cache_read_input_tokens"] or 0, usage.get("cache_creation_input_tokens") or 0
                    self.prompt, self.cached = (usage.get("input_tokens") or 0) + read + made, read

    def record(self) -> dict:
        end = time.perf_counter()
        return {"ttft_s": (self.first or end) - self.start, "gaps": self.gaps, "end": end, "start": self.start,
                "completion_tokens": self.completion if self.completion is not None else self.pieces,
                "prompt_tokens": self.prompt, "cached_tokens": self.cached}


async def one_request(client, url: str, api: str, model: str, messages: List[dict], max_tokens: int, key: str) -> dict:
    """Stream one reply through `api`; its record (see the module docstring)."""
    reading = Reading(time.perf_counter())
    headers = {"anthropic-version": "2023-06-01", "x-api-key": "local"} if api == "messages" else {}
    async with client.stream("POST", url + PATHS[api], json=body(api, model, messages, max_tokens, key),
                             headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}{PATHS[api]}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                reading.event(api, json.loads(line[6:]))
    return reading.record()
