"""Reply parts (flow.run_job) -> the Responses API's output: stream events and the final Response object.

One builder serves both modes: a streamed reply sends every event it returns; a non-streamed one only
keeps the Response it ends with. Events follow OpenAI's order: response.created, response.in_progress,
then per output item output_item.added, (content_part.added, output_text.delta..., output_text.done,
content_part.done) or (function_call_arguments.delta..., function_call_arguments.done), output_item.done,
and response.completed (response.incomplete when max_output_tokens cut it; response.failed on an error).
"""

import time
import uuid
from typing import List, Optional


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class Output:
    """Turns one reply's parts into events; `response` is the Response object as it stands."""

    def __init__(self, response: dict, call_id: str):
        self.response, self.call_id = response, call_id
        self.seq = 0
        self.item: Optional[dict] = None
        self.text = ""

    def _event(self, type_: str, **fields) -> dict:
        ev = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def _where(self) -> dict:
        return {"item_id": self.item["id"], "output_index": 0}

    def start(self) -> List[dict]:
        return [self._event("response.created", response=dict(self.response)),
                self._event("response.in_progress", response=dict(self.response))]

    def _open(self, kind: str, name: str = "") -> List[dict]:
        if kind == "message":
            self.item = {"id": _item_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                         "content": []}
            return [self._event("response.output_item.added", output_index=0, item=dict(self.item)),
                    self._event("response.content_part.added", **self._where(), content_index=0,
                                part=_text_part(""))]
        self.item = {"id": _item_id("fc"), "type": "function_call", "status": "in_progress",
                     "call_id": self.call_id, "name": name, "arguments": ""}
        return [self._event("response.output_item.added", output_index=0, item=dict(self.item))]

    def part(self, what: str, text: str) -> List[dict]:
        """Events for one part: ('content', text), ('call', name) or ('args', fragment)."""
        if what == "call":
            return self._open("function_call", text)
        events = self._open("message") if self.item is None else []
        self.text += text
        if what == "content":
            events.append(self._event("response.output_text.delta", **self._where(), content_index=0, delta=text,
                                      logprobs=[]))
        elif text:
            events.append(self._event("response.function_call_arguments.delta", **self._where(), delta=text))
        return events

    def done(self, call: Optional[dict], stats: dict, n_prompt: int) -> List[dict]:
        """Close the item and the response: status, usage and the last events."""
        events = self._open("message") if self.item is None else []
        cut = call is None and stats.get("finish_reason") == "length"
        status = "incomplete" if cut else "completed"
        item = self.item
        item["status"] = status
        if item["type"] == "message":
            part = _text_part(self.text)
            item["content"] = [part]
            events += [self._event("response.output_text.done", **self._where(), content_index=0, text=self.text,
                                   logprobs=[]),
                       self._event("response.content_part.done", **self._where(), content_index=0, part=part)]
        else:
            item["arguments"] = call["arguments"] if call else self.text
            events.append(self._event("response.function_call_arguments.done", **self._where(),
                                      name=item["name"], arguments=item["arguments"]))
        events.append(self._event("response.output_item.done", output_index=0, item=item))
        gen, cached = stats.get("generated_tokens", 0), stats.get("reused_tokens", 0)
        self.response.update(
            status=status, output=[item], completed_at=int(time.time()) if not cut else None,
            incomplete_details={"reason": "max_output_tokens"} if cut else None,
            usage={"input_tokens": n_prompt, "input_tokens_details": {"cached_tokens": cached},
                   "output_tokens": gen, "output_tokens_details": {"reasoning_tokens": 0},
                   "total_tokens": n_prompt + gen})
        events.append(self._event("response.incomplete" if cut else "response.completed", response=self.response))
        return events

    def failed(self, status: int, message: str) -> dict:
        """The response.failed event for an error after the stream began. `error.code` takes one of the
        values OpenAI's spec allows: `invalid_prompt` for the client's mistakes, else `server_error`."""
        code = "invalid_prompt" if 400 <= status < 500 and status != 429 else "server_error"
        self.response.update(status="failed", error={"code": code, "message": message})
        return self._event("response.failed", response=self.response)

    def assistant_message(self) -> dict:
        """This reply as a chat message, for the stored conversation."""
        item = self.item or {}
        if item.get("type") == "function_call" and item.get("status") == "completed":
            return {"role": "assistant", "content": None, "tool_calls": [{
                "id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}]}
        return {"role": "assistant", "content": self.text}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
