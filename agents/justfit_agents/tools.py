"""Tools are plain Python functions: type hints (through schema.py) and the docstring become a JSON schema."""

import inspect
import json
import re
from dataclasses import dataclass
from typing import Callable, Dict, Optional

from .schema import parameters_schema


@dataclass
class Tool:
    """A callable the model may call: name, one-line description, JSON schema of its arguments."""

    name: str
    description: str
    parameters: dict
    fn: Callable

    def schema(self) -> dict:
        """The OpenAI-style function schema most chat templates expect."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def __call__(self, **kwargs):
        return self.fn(**kwargs)


def parse_docstring(doc: str):
    """(summary, {arg: description}) from a docstring with an `Args:` section (Google style) or
    `:param name:` lines."""
    doc = inspect.cleandoc(doc or "")
    summary = doc.split("\n\n")[0].replace("\n", " ").strip()
    args = {}
    m = re.search(r"^(Args|Arguments|Parameters):\s*$(.*?)(^\S|\Z)", doc, re.M | re.S)
    if m:
        for line in m.group(2).splitlines():
            hit = re.match(r"\s+(\w+)(?:\s*\([^)]*\))?\s*:\s*(.+)", line)
            if hit:
                args[hit.group(1)] = hit.group(2).strip()
    for hit in re.finditer(r":param\s+(\w+):\s*(.+)", doc):
        args[hit.group(1)] = hit.group(2).strip()
    return summary, args


def as_tool(fn, name: Optional[str] = None) -> Tool:
    """Wrap a function (or return a Tool as is): parameters from its signature and type hints."""
    if isinstance(fn, Tool):
        return fn
    summary, arg_docs = parse_docstring(fn.__doc__)
    params = parameters_schema(fn)
    for arg, text in arg_docs.items():
        if arg in params["properties"]:
            params["properties"][arg]["description"] = text
    return Tool(name or fn.__name__, summary or fn.__name__, params, fn)


def tool(fn=None, *, name: Optional[str] = None):
    """Decorator form of as_tool: `@tool` or `@tool(name="x")`."""
    if fn is None:
        return lambda f: as_tool(f, name)
    return as_tool(fn, name)


def as_tools(items) -> Dict[str, Tool]:
    """Name -> Tool for a list of functions/Tools; duplicate names are an error."""
    out: Dict[str, Tool] = {}
    for item in items or []:
        t = as_tool(item)
        if t.name in out:
            raise ValueError(f"two tools are named {t.name!r}")
        out[t.name] = t
    return out


def to_text(value) -> str:
    """A tool's return value as text for the model: strings as is, the rest as JSON."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)


def truncate(text: str, tokenizer, max_tokens: int) -> str:
    """Keep a result within max_tokens of the model's tokenizer; say so at the end when cut."""
    ids = tokenizer.encode(text, add_special_tokens=False) if tokenizer is not None else text.split()
    if len(ids) <= max_tokens:
        return text
    keep = tokenizer.decode(ids[:max_tokens]) if tokenizer is not None else " ".join(ids[:max_tokens])
    return f"{keep}\n[truncated: showed {max_tokens} of {len(ids)} tokens]"


def call_tool(t: Tool, arguments: dict) -> str:
    """Run a tool; its exceptions become an 'error: ...' result the model can read."""
    try:
        return to_text(t(**arguments))
    except Exception as e:  # a tool failing is information for the model, not a crash of the loop
        return f"error: {type(e).__name__}: {e}"
