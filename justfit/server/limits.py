"""The documented limits on what one request may hold (API.md, "Limits"), checked before any work.

A request within the body size limit can still hold values that make Python or the tokenizer fail
(a lone UTF-16 surrogate, JSON nested thousands deep, an integer thousands of digits long, a tool
schema too deep for the grammar compiler). Each is refused here as a 400 naming where it sits.
"""

import json
import math
from typing import Any

MAX_DEPTH = 64  # nesting of arrays and objects anywhere in a body or in a tool call's `arguments`
MAX_INT_DIGITS = 20  # an integer's digits (every 64-bit value fits)
MAX_SCHEMA_DEPTH = 32  # nesting of arrays and objects inside one JSON schema (tool parameters, response_format)
MAX_SCHEMA_VALUES = 10_000  # JSON values (objects, arrays, strings, numbers...) in one schema
MAX_TOOLS = 128  # tools per request (OpenAI's limit)
MAX_STOP = 4  # stop strings per request (OpenAI's limit)


class LimitError(ValueError):
    """A request value beyond a limit; `path` locates it inside the checked value ('' for itself)."""

    def __init__(self, message: str, path: str = ""):
        super().__init__(message)
        self.message, self.path = message, path


def _sub(path: str, key) -> str:
    return f"{path}[{key}]" if isinstance(key, int) else (f"{path}.{key}" if path else str(key))


def check_value(value: Any, max_depth: int = MAX_DEPTH, path: str = "") -> int:
    """Walk a parsed JSON value: refuse nesting deeper than `max_depth`, lone surrogates in strings
    (and keys), integers over MAX_INT_DIGITS digits and non-finite floats. Returns how many values it
    holds. Iterative, so a value nested past Python's recursion limit is refused, not crashed on."""
    count, stack = 0, [(value, path, 0)]
    while stack:
        v, where, depth = stack.pop()
        count += 1
        if isinstance(v, str):
            check_text(v, where)
        elif isinstance(v, bool) or v is None:
            continue
        elif isinstance(v, int):
            check_int(v, where)
        elif isinstance(v, float):
            if not math.isfinite(v):
                raise LimitError(f"{v} is not a JSON number (NaN and infinities are refused)", where)
        elif isinstance(v, (dict, list)):
            if depth >= max_depth:
                raise LimitError(f"nested deeper than {max_depth} levels of arrays and objects", where)
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, x in items:
                if isinstance(k, str):
                    check_text(k, where)
                stack.append((x, _sub(where, k), depth + 1))
    return count


def check_text(s: str, path: str = ""):
    """Refuse a string holding a lone UTF-16 surrogate (JSON lets `\\ud800` through; UTF-8 cannot
    encode it, so the tokenizer would fail on it)."""
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise LimitError(f"a string holds a lone UTF-16 surrogate ({s[e.start]!r} at character {e.start}); "
                         "send valid Unicode text", path) from None


def check_int(n: int, path: str = ""):
    if abs(n) >= 10 ** MAX_INT_DIGITS:
        raise LimitError(f"an integer longer than {MAX_INT_DIGITS} digits", path)


def check_schema(schema: Any, path: str = "") -> Any:
    """A JSON schema within MAX_SCHEMA_DEPTH levels and MAX_SCHEMA_VALUES values (deeper or larger
    schemas overflow the grammar compiler's recursion or take seconds to compile)."""
    if check_value(schema, MAX_SCHEMA_DEPTH, path) > MAX_SCHEMA_VALUES:
        raise LimitError(f"a JSON schema over {MAX_SCHEMA_VALUES} values", path)
    return schema


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise LimitError(f"an integer longer than {MAX_INT_DIGITS} digits")
    return int(text)


def _float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise LimitError(f"{text} overflows a 64-bit float")
    return v


def _constant(name: str):
    raise LimitError(f"{name} is not JSON")


def parse_json(text: str) -> Any:
    """json.loads under the same limits as a request body: raises LimitError for a value beyond them
    and json.JSONDecodeError for text that is not JSON."""
    try:
        value = json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except RecursionError:
        raise LimitError(f"nested deeper than {MAX_DEPTH} levels of arrays and objects") from None
    check_value(value)
    return value
