"""Tool argument schemas come from pydantic: every common hint works, and the grammar accepts them."""

import enum
from typing import List, Literal, Optional

import pytest

from justfit.grammar import closed, validate
from justfit_agents.schema import parameters_schema
from justfit_agents.tools import as_tool


class Depth(enum.Enum):
    fast = "fast"
    deep = "deep"


def lookup(query: str, where: str | None = None, limit: Optional[int] = None, mode: Literal["a", "b"] = "a",
           tags: list[str] = [], names: List[str] = [], depth: Depth = Depth.fast, weight: float = 0.5) -> str:  # noqa: B006
    """Look something up.

    Args:
        query: what to find
        depth: how hard to look
    """
    return query


def test_every_common_hint_has_a_schema():
    p = parameters_schema(lookup)
    props = p["properties"]
    assert p["type"] == "object" and p["required"] == ["query"]
    assert props["query"] == {"type": "string"}
    assert props["where"] == {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None}
    assert props["limit"] == {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None}
    assert props["mode"] == {"type": "string", "enum": ["a", "b"], "default": "a"}
    assert props["tags"] == {"type": "array", "items": {"type": "string"}, "default": []}
    assert props["names"] == props["tags"]
    assert props["depth"] == {"type": "string", "enum": ["fast", "deep"], "default": "fast"}  # $ref inlined
    assert props["weight"] == {"type": "number", "default": 0.5}
    assert "$defs" not in p and "title" not in str(p)


def test_as_tool_adds_docstring_descriptions_and_the_grammar_checks_values():
    t = as_tool(lookup)
    assert t.description == "Look something up."
    assert t.parameters["properties"]["depth"]["description"] == "how hard to look"
    s = closed(t.parameters, 100)
    assert validate({"query": "x", "where": None, "depth": "deep", "tags": ["a"]}, s) == []
    assert validate({"query": "x", "depth": "slow"}, s)  # not an enum value
    assert validate({"where": "x"}, s)  # query missing
    assert validate({"query": "x", "mode": "c"}, s)  # not a Literal value


def test_property_named_title_survives():
    def note(title: str, body: str = "") -> str:
        return title

    assert parameters_schema(note)["properties"]["title"] == {"type": "string"}


def test_a_hint_without_schema_is_a_clear_error():
    class Opaque:
        pass

    def f(x: Opaque) -> str:
        return ""

    with pytest.raises(TypeError, match="no JSON schema"):
        as_tool(f)
