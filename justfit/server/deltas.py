"""Engine text -> OpenAI message parts: plain content, or one tool call whose name is sent first and
whose JSON arguments follow as fragments while the model writes them (the grammar keeps the call
compact, `{"name": "N", "ARGS_KEY": {...}}`, so the arguments are a contiguous slice of the text)."""

import json
import uuid
from typing import List, Optional, Tuple


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class Reply:
    """Feed engine text with add(); it returns ('content', text) / ('call', name) / ('args', fragment)
    parts ready to stream. With no tools it passes text through."""

    def __init__(self, syntax=None, tools: bool = False):
        self.syntax, self.tools = syntax, tools
        self.text = ""
        self.mode: Optional[str] = None if tools else "content"
        self.name: Optional[str] = None
        self.args_start: Optional[int] = None
        self.args_sent = 0
        self.id = call_id()

    def add(self, piece: str) -> List[Tuple[str, str]]:
        self.text += piece
        if self.mode == "content":
            return [("content", piece)] if piece else []
        if self.mode is None:
            head = self.text.lstrip()
            if not head:
                return []
            first = (self.syntax.prefix or "{").strip()[0]
            if head[0] != first:
                self.mode = "content"
                return [("content", self.text)]
            self.mode = "call"
        return self._call_parts()

    def _call_parts(self) -> List[Tuple[str, str]]:
        out = []
        key = f'"{self.syntax.args_key}": '
        if self.name is None:
            i = self.text.find(key)
            start = self.text.find('"name": "')
            if i < 0 or start < 0:
                return out
            name_end = self.text.find('"', start + 9)
            self.name = self.text[start + 9:name_end]
            self.args_start = i + len(key)
            out.append(("call", self.name))
        # hold back what may be the closing brace and the suffix, sent by finish()
        hold = 1 + len(self.syntax.suffix) + 1
        end = max(self.args_start, len(self.text) - hold)
        if end > self.args_start + self.args_sent:
            out.append(("args", self.text[self.args_start + self.args_sent:end]))
            self.args_sent = end - self.args_start
        return out

    def finish(self) -> Tuple[List[Tuple[str, str]], Optional[dict]]:
        """(the parts still held back, the parsed call {'name', 'arguments'} or None)."""
        if self.mode != "call":
            if self.mode is None and self.text:
                return [("content", self.text)], None
            return [], None
        parsed = self.syntax.parse(self.text)
        if parsed is None or self.name is None:  # cut by max_tokens: what was written is all there is
            rest = self.text[self.args_start + self.args_sent:] if self.args_start is not None else ""
            return ([("args", rest)] if rest else []), None
        full = json.dumps(parsed["arguments"], ensure_ascii=False)
        raw = self.raw_args()
        if raw is not None and json.loads(raw) == parsed["arguments"]:
            full = raw
        sent = self.text[self.args_start:self.args_start + self.args_sent]
        # the streamed fragments are a prefix of the raw arguments, so clients that join them get `full`
        parts = [("args", full[len(sent):])] if full.startswith(sent) and len(full) > len(sent) else []
        return parts, {"name": parsed["name"], "arguments": full}

    def raw_args(self) -> Optional[str]:
        """The arguments exactly as written: from after the key to the outer object's closing brace."""
        body = self.text[self.args_start:]
        suffix = self.syntax.suffix.strip()
        if suffix and suffix in body:
            body = body[:body.rindex(suffix)]
        body = body.rstrip()
        if not body.endswith("}"):
            return None
        body = body[:-1].rstrip()
        try:
            json.loads(body)
        except json.JSONDecodeError:
            return None
        return body
