"""Tools: JSON schema from type hints and docstrings, truncation, call syntaxes, grammars."""

import json
from typing import List, Literal, Optional

import pytest

from tests import agents_support  # noqa: F401  (puts agents/ on sys.path)
from justfit.grammar import call_schema, choice_name, closed, lark_grammar, validate
from justfit.toolcalls import SYNTAXES, detect
from justfit_agents.tools import as_tool, truncate


def search(query: str, limit: int = 5, exact: Optional[bool] = None, tags: List[str] = (),
           mode: Literal["fast", "deep"] = "fast", weight: float = 1.0) -> str:
    """Search the notes.

    Longer text that is not the summary.

    Args:
        query: words to look for
        limit (int): most hits to return
        mode: how hard to look
    """
    return query


def test_schema_from_type_hints_and_docstring():
    t = as_tool(search)
    assert t.name == "search" and t.description == "Search the notes."
    p = t.parameters
    assert p["required"] == ["query"]
    props = p["properties"]
    assert props["query"] == {"type": "string", "description": "words to look for"}
    assert props["limit"] == {"type": "integer", "description": "most hits to return", "default": 5}
    assert props["exact"]["anyOf"] == [{"type": "boolean"}, {"type": "null"}]  # Optional keeps its null
    assert props["tags"]["type"] == "array" and props["tags"]["items"] == {"type": "string"}
    assert props["mode"]["enum"] == ["fast", "deep"] and props["mode"]["description"] == "how hard to look"
    assert props["weight"]["type"] == "number"
    assert t.schema()["function"]["parameters"] is p


def test_unsupported_hint_is_a_clear_error():
    class Opaque:  # no JSON form (set, list, Literal... all have one now)
        pass

    def f(x: Opaque) -> str:
        return ""

    with pytest.raises(TypeError, match="no JSON schema"):
        as_tool(f)


def test_truncate_keeps_budget_and_says_so(default_model_dir):
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(default_model_dir)
    text = " ".join(f"word{i}" for i in range(400))
    out = truncate(text, tok, 50)
    assert out.endswith(f"of {len(tok.encode(text, add_special_tokens=False))} tokens]")
    assert "[truncated: showed 50" in out
    assert len(tok.encode(out.split("\n[truncated")[0], add_special_tokens=False)) <= 52
    assert truncate("short", tok, 50) == "short"


def test_syntax_round_trip():
    for syn in SYNTAXES.values():
        text = syn.call_text("search", {"query": "a \"b\"", "limit": 2})
        assert syn.parse(text) == {"name": "search", "arguments": {"query": "a \"b\"", "limit": 2}}
        assert syn.parse("The answer is 4.") is None


def test_detect_by_template():
    class T:
        chat_template = None

    t = T()
    t.chat_template = "{% for m in messages %}<|im_start|>{{m.role}}{% endfor %}"
    assert detect(t).name == "justfit"
    t.chat_template = "{% if tools %}<tools>{{tools}}</tools><tool_call>{% endif %}"
    assert detect(t).name == "hermes"
    t.chat_template = "<|start_header_id|>ipython<|end_header_id|>{{ tools }}<|eot_id|>"
    assert detect(t).name == "llama3"


def test_validate_and_closed_schema():
    schema = closed(as_tool(search).parameters, max_string=10)
    assert schema["additionalProperties"] is False and schema["properties"]["query"]["maxLength"] == 10
    assert validate({"query": "hi", "limit": 3}, schema) == []
    assert validate({"query": "hi", "other": 1}, schema)
    assert validate({"limit": 3}, schema)
    assert validate({"query": "x" * 11}, schema)
    assert validate({"query": "hi", "limit": True}, schema)
    assert validate({"query": "hi", "mode": "slow"}, schema)


def test_grammar_compiles_and_rejects_bad_choice():
    t = as_tool(search)
    for syn in SYNTAXES.values():
        for choice in ("auto", "required", {"name": "search"}, {"type": "function", "function": {"name": "search"}}):
            g = lark_grammar([t], syn, choice)
            assert g.startswith("start: call") and "%json" in g
            assert ("answer" in g) == (choice == "auto")
    assert lark_grammar([t], SYNTAXES["justfit"], "none") is None
    with pytest.raises(ValueError):
        lark_grammar([t], SYNTAXES["justfit"], {"name": "missing"})
    with pytest.raises(ValueError):
        choice_name("sometimes")
    s = call_schema([t, as_tool(truncate)], SYNTAXES["justfit"], 50)
    assert len(s["anyOf"]) == 2 and json.dumps(s)
