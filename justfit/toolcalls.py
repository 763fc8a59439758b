"""Tool-call syntax per model family: how tools, calls and results look in the prompt.

- "hermes" (Qwen 2.5/3, Hermes): the chat template takes `tools=`; a call is
  `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`; results are `tool` messages.
- "llama3" (Llama 3.1+): the template takes `tools=`; a call is the bare JSON object
  `{"name": ..., "parameters": {...}}`; results are `tool` (ipython) messages.
- "justfit" (any template without tool support, e.g. SmolLM2): the tool list and the call syntax
  are written into the system message (below); calls use the Hermes tags; each result comes back
  as a user message `<tool_response name="NAME">\nRESULT\n</tool_response>`.
Tools are any objects with `.schema()` returning the OpenAI function schema.
"""

import json
import re
from dataclasses import dataclass
from typing import List, Optional

JUSTFIT_TOOL_PROMPT = """# Tools
You can call these tools; each line is one tool's JSON schema:
{tools}

To call a tool, reply with only this, filled in:
<tool_call>
{{"name": "TOOL_NAME", "arguments": {{ARGUMENTS_AS_JSON}}}}
</tool_call>
The result comes back inside <tool_response>...</tool_response>. {finish}"""

FINISH_TEXT = "When you know the answer, reply with it in plain text, without a tool call."
FINISH_TOOL = "When you know the answer, call final_answer with it."


def describe(tools: list) -> str:
    """One JSON line per tool, for prompts of models without native tool syntax."""
    return "\n".join(json.dumps(t.schema()["function"], ensure_ascii=False) for t in tools)


@dataclass
class Syntax:
    """One family's tool-call syntax: the text around the JSON call and the key for arguments."""

    name: str
    prefix: str
    suffix: str
    args_key: str
    native: bool  # the chat template renders tools itself

    def call_text(self, name: str, arguments: dict) -> str:
        """The exact text of a call, as the model is asked to write it."""
        body = json.dumps({"name": name, self.args_key: arguments}, ensure_ascii=False)
        return f"{self.prefix}{body}{self.suffix}"

    def parse(self, text: str) -> Optional[dict]:
        """{'name', 'arguments'} of the first call in text, or None when the text is not a call."""
        if self.prefix:
            m = re.search(re.escape(self.prefix.strip()) + r"\s*(\{.*\})\s*" + re.escape(self.suffix.strip()), text, re.S)
            if m is None:
                return None
            body = m.group(1)
        else:
            body = text.strip()
            if not body.startswith("{"):
                return None
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get(self.args_key, obj.get("arguments", {}))
        return {"name": obj["name"], "arguments": args if isinstance(args, dict) else {}}

    def tool_message(self, name: str, result: str) -> dict:
        """The message that carries a tool's result back to the model."""
        if self.native:
            return {"role": "tool", "name": name, "content": result}
        return {"role": "user", "content": f'<tool_response name="{name}">\n{result}\n</tool_response>'}

    def render(self, tokenizer, messages: List[dict], tools: list, finish: str,
               generation_prompt: bool = True) -> str:
        """The whole conversation as prompt text: tools either through the template or written
        into the system message."""
        msgs = [dict(m) for m in messages]
        if not self.native and tools:
            section = JUSTFIT_TOOL_PROMPT.format(tools=describe(tools), finish=finish)
            if msgs and msgs[0]["role"] == "system":
                msgs[0]["content"] = f"{msgs[0]['content']}\n\n{section}"
            else:
                msgs.insert(0, {"role": "system", "content": section})
        schemas = [t.schema() for t in tools] if self.native and tools else None
        if not getattr(tokenizer, "chat_template", None):
            text = "".join(f"{m['role']}: {m['content']}\n" for m in msgs)
            return text + ("assistant: " if generation_prompt else "")
        kwargs = {"tools": schemas} if schemas else {}
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=generation_prompt,
                                             tokenize=False, **kwargs)


SYNTAXES = {
    "hermes": Syntax("hermes", "<tool_call>\n", "\n</tool_call>", "arguments", True),
    "llama3": Syntax("llama3", "", "", "parameters", True),
    "justfit": Syntax("justfit", "<tool_call>\n", "\n</tool_call>", "arguments", False),
}


def detect(tokenizer) -> Syntax:
    """The syntax the model's chat template speaks; JustFit's own when it has none."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):
        template = json.dumps(template)
    if "<tool_call>" in template and "tools" in template:
        return SYNTAXES["hermes"]
    if "<|eot_id|>" in template and ("ipython" in template or "<|python_tag|>" in template):
        return SYNTAXES["llama3"]
    return SYNTAXES["justfit"]
