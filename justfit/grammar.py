"""Constrained decoding with llguidance: every emitted tool call or JSON reply parses and validates.

A Constraint masks logits before sampling and follows the sampled tokens (the interface the token loop
takes as `constraint=`). Grammars are Lark with embedded JSON schemas (`%json`): a tool call's name is a
`const` per tool and its arguments follow the tool's schema (closed objects, strings capped at
`max_string` chars so a call fits in the token budget). tool_choice "auto" also allows a plain-text
answer (which may not start with the call's first character); "required" and {name} allow only calls.
Tools are any objects with `.name` and `.parameters` (a JSON schema).
"""

import copy
import json
from typing import Dict, List, Optional, Union

import numpy as np

from .toolcalls import Syntax

ToolChoice = Union[str, dict]
_TOKENIZERS: Dict[int, object] = {}
# compact JSON with fixed separators: no room for runs of whitespace, which small models love
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def choice_name(tool_choice: ToolChoice) -> Optional[str]:
    """The forced tool's name for a {name} choice (also OpenAI's {"function": {"name"}}), else None."""
    if isinstance(tool_choice, dict):
        name = tool_choice.get("name") or (tool_choice.get("function") or {}).get("name")
        if not name:
            raise ValueError(f"tool_choice dict needs a name: {tool_choice!r}")
        return name
    if tool_choice not in ("auto", "required", "none"):
        raise ValueError(f"tool_choice must be 'auto', 'required', 'none' or {{'name': ...}}, not {tool_choice!r}")
    return None


def closed(schema: dict, max_string: Optional[int]) -> dict:
    """A copy of a schema with objects closed and strings capped (None: uncapped), for the grammar."""
    s = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if node.get("type") == "object":
                node.setdefault("additionalProperties", False)
                node.setdefault("properties", {})
            if node.get("type") == "string" and max_string is not None:
                node["maxLength"] = min(node.get("maxLength", max_string), max_string)
            node.pop("default", None)
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(s)
    return s


def call_schema(tools: list, syntax: Syntax, max_string: int) -> dict:
    """JSON schema of one call to any of `tools`: {"name": const, args_key: that tool's schema}."""
    options = [{"type": "object",
                "properties": {"name": {"const": t.name}, syntax.args_key: closed(t.parameters, max_string)},
                "required": ["name", syntax.args_key], "additionalProperties": False} for t in tools]
    schema = dict(options[0]) if len(options) == 1 else {"anyOf": options}
    schema["x-guidance"] = COMPACT
    return schema


def lark_grammar(tools: list, syntax: Syntax, tool_choice: ToolChoice, max_string: int = 500) -> Optional[str]:
    """The Lark grammar for one assistant reply with tools, or None when nothing is constrained."""
    forced = choice_name(tool_choice)
    if tool_choice == "none" or not tools:
        return None
    if forced is not None:
        tools = [t for t in tools if t.name == forced]
        if not tools:
            raise ValueError(f"tool_choice names {forced!r}, which is not one of the tools")
    lit = lambda s: json.dumps(s)  # noqa: E731  (a Lark string literal is a JSON string)
    call = "call: " + " ".join(x for x in (lit(syntax.prefix) if syntax.prefix else "", "body",
                                            lit(syntax.suffix) if syntax.suffix else "") if x)
    rules = [call, "body: %json " + json.dumps(call_schema(tools, syntax, max_string))]
    if tool_choice == "auto":
        rules.insert(0, "start: call | answer")
        rules.append(_answer_rule(syntax))
    else:
        rules.insert(0, "start: call")
    return "\n".join(rules) + "\n"


def _answer_rule(syntax: Syntax) -> str:
    """Plain text that cannot be mistaken for a call: it may not start with the call's first character."""
    first = (syntax.prefix or "{")[0]
    return f"answer: /[^{json.dumps(first)[1:-1]}\\s][\\s\\S]*/"


def answer_grammar(syntax: Syntax) -> str:
    """tool_choice "none" with the tools still in the prompt: a text answer, never a call."""
    return "start: answer\n" + _answer_rule(syntax) + "\n"


def json_grammar(schema: Optional[dict] = None, strict: bool = False) -> str:
    """The Lark grammar of a JSON reply: any JSON object (schema None) or one following `schema`
    (strict: objects closed, as OpenAI's strict mode requires)."""
    s = closed(schema, None) if schema is not None and strict else dict(schema or {"type": "object"})
    s["x-guidance"] = COMPACT
    return "start: %json " + json.dumps(s) + "\n"


def check_grammar(grammar: str) -> Optional[str]:
    """Why llguidance refuses a grammar (a bad schema), or None when it compiles."""
    import llguidance as llg

    bad, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    return "; ".join(m.split("\n")[0] for m in messages) or "invalid grammar" if bad else None


def ll_tokenizer(tokenizer, n_vocab: int):
    """llguidance's view of the model tokenizer (built once per tokenizer: ~3 s)."""
    key = id(tokenizer)
    if key not in _TOKENIZERS:
        from llguidance.hf import from_tokenizer

        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [hf.eos_token_id])
        _TOKENIZERS[key] = from_tokenizer(hf, n_vocab=n_vocab, eos_token=eos[0])
    return _TOKENIZERS[key]


class Constraint:
    """One reply's grammar state: masks logits before sampling and follows the sampled tokens."""

    def __init__(self, tokenizer, n_vocab: int, grammar: str):
        import llguidance as llg

        self.n_vocab, self.grammar = n_vocab, grammar  # the text: rebuilt on the other ranks under mlx.launch
        self.matcher = llg.LLMatcher(ll_tokenizer(tokenizer, n_vocab), grammar)
        if self.matcher.is_error():
            raise ValueError(f"bad grammar: {self.matcher.get_error()}")
        self.words = np.zeros(((n_vocab + 31) // 32,), dtype=np.int32)

    def allowed(self) -> np.ndarray:
        """Boolean mask over the vocabulary of tokens that keep the output valid."""
        self.matcher.unsafe_compute_mask_ptr(self.words.ctypes.data, self.words.nbytes)
        return np.unpackbits(self.words.view(np.uint8), bitorder="little")[: self.n_vocab].astype(bool)

    def apply(self, logits):
        """Logits with every disallowed token set to -inf."""
        import mlx.core as mx

        return mx.where(mx.array(self.allowed()), logits, -mx.inf)

    def forced(self) -> List[int]:
        """Tokens the grammar allows no alternative to (consumed here); [] when there is a choice."""
        ff = self.matcher.compute_ff_tokens()
        if ff and not self.matcher.consume_tokens(ff):
            raise RuntimeError(f"grammar rejected its own forced tokens: {self.matcher.get_error()}")
        return ff

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"grammar rejected token {token}: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """True once the grammar is complete and nothing but end-of-turn may follow."""
        return self.matcher.is_stopped()


def validate(value, schema: dict, path: str = "$") -> List[str]:
    """Errors of value against the JSON-schema subset tools use (type, enum, const, properties,
    required, additionalProperties, items, anyOf, maxLength); [] when valid."""
    errs: List[str] = []
    if "anyOf" in schema:
        return [] if any(not validate(value, s, path) for s in schema["anyOf"]) else [f"{path}: matches no option"]
    if "const" in schema and value != schema["const"]:
        errs.append(f"{path}: expected {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        errs.append(f"{path}: {value!r} not in {schema['enum']}")
    kinds = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict}
    t = schema.get("type")
    if t in kinds and (not isinstance(value, kinds[t]) or (t in ("integer", "number") and isinstance(value, bool))):
        return errs + [f"{path}: expected {t}, got {type(value).__name__}"]
    if t == "string" and len(value) > schema.get("maxLength", len(value)):
        errs.append(f"{path}: longer than {schema['maxLength']}")
    if t == "array" and "items" in schema:
        for i, v in enumerate(value):
            errs += validate(v, schema["items"], f"{path}[{i}]")
    if t == "object":
        props = schema.get("properties", {})
        errs += [f"{path}: missing {k!r}" for k in schema.get("required", []) if k not in value]
        for k, v in value.items():
            if k in props:
                errs += validate(v, props[k], f"{path}.{k}")
            elif schema.get("additionalProperties") is False:
                errs.append(f"{path}: unexpected {k!r}")
    return errs
