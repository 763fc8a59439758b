"""The one chat-template renderer: messages -> the model's prompt text and token ids.

Chat, sessions, agents and the server all render through here, so the same messages always give the
same ids. A tokenizer without a chat template gets the contents joined by newlines.
"""

from typing import List


def _plain(messages: List[dict]) -> List[dict]:
    """Only the fields templates read: role and content (plus tool-call fields when present)."""
    keep = ("role", "content", "name", "tool_calls", "tool_call_id")
    return [{k: m[k] for k in keep if k in m} for m in messages]


def chat_text(tokenizer, messages: List[dict], add_generation_prompt: bool = True) -> str:
    """The prompt text of `messages` (empty for no messages)."""
    if not messages:
        return ""
    msgs = _plain(messages)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, tokenize=False)
    return "\n".join(str(m.get("content") or "") for m in msgs) + ("\n" if add_generation_prompt else "")


def encode_text(tokenizer, text: str, first: bool = True) -> List[int]:
    """Ids of rendered text: templates already carry their special tokens; plain text gets BOS when first."""
    special = first and not getattr(tokenizer, "chat_template", None)
    return list(tokenizer.encode(text, add_special_tokens=special))


def render_chat(tokenizer, messages: List[dict], add_generation_prompt: bool = True) -> List[int]:
    """Token ids of `messages` through the chat template."""
    return encode_text(tokenizer, chat_text(tokenizer, messages, add_generation_prompt))
