"""JustFit agents: tool-using loops on a JustFit Runtime (import name `justfit_agents`, so the
PyPI package that installs a top-level `agents` module is never shadowed)."""

from .agent import Agent, Event, Result, Step, ToolCall, final_answer
from .tools import Tool, as_tool, tool, truncate

__all__ = ["Agent", "Event", "Result", "Step", "ToolCall", "Tool", "as_tool", "tool", "truncate", "final_answer"]
