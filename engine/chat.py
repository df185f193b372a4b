"""Chat messages -> prompt token ids through the model's chat template.

One function serves `engine.LLM.chat` and the OpenAI front door's `/v1/chat/completions`,
so both render a conversation the same way. Messages are OpenAI-shaped:
`{"role": "user", "content": "..."}`, where content may also be a list of
`{"type": "text", "text": "..."}` parts. ValueErrors name the offending field
(`messages[1].content ...`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")


def normalize_messages(messages: Any) -> list[dict[str, str]]:
    """Plain `{"role", "content"}` dicts with text content; ValueError names the field."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of {role, content} objects")
    if not messages:
        raise ValueError("messages is empty")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be an object with role and content")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {list(ROLES)}, got {role!r}")
        out.append({"role": role, "content": _text(m.get("content"), f"messages[{i}].content")})
    return out


def _text(content: Any, name: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"{name}[{j}] must be a text part "
                                 f"({{\"type\": \"text\", \"text\": ...}}); got type {kind!r}")
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError(f"{name} must be a string or a list of text parts")


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(tokenizer, messages: Any, *, add_generation_prompt: bool = True,
                chat_template: str | None = None) -> list[int]:
    """Token ids of `messages` rendered by the tokenizer's (or the given) chat template."""
    msgs = normalize_messages(messages)
    if chat_template is None and not has_chat_template(tokenizer):
        raise ValueError("messages: this model has no chat template (its tokenizer_config "
                         "or chat_template.jinja defines none); send a plain prompt instead")
    try:
        ids = tokenizer.apply_chat_template(
            msgs, add_generation_prompt=add_generation_prompt, tokenize=True,
            chat_template=chat_template, return_dict=False)
    except Exception as e:  # a template may raise anything on a conversation it rejects
        raise ValueError(f"messages: the chat template rejected the conversation ({e})") from e
    if isinstance(ids, Mapping):  # some transformers versions return a BatchEncoding
        ids = ids["input_ids"]
    ids = [int(t) for t in ids]
    if not ids:
        raise ValueError("messages: the chat template rendered no tokens")
    return ids
