"""The tiny default's chat template with tools: the same text as its plain template where no tools, tool
calls or tool results appear, else tools listed in a system turn, each call as ``<call>{json}</call>`` in the
assistant's turn and each result as a ``tool`` turn; and the response template that parses those calls
(transformers' response parsing, which TRL's ``parse_response`` reads)."""

from __future__ import annotations

from typing import Any

TOOLS_CHAT_TEMPLATE = (
    "{% if tools %}<|system|>tools:{% for tool in tools %} {{ tool['function']['name'] }}"
    "{% endfor %}<|endoftext|>{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}"
    "{% if message['tool_calls'] %}{% for call in message['tool_calls'] %}<call>{{ {'name': call['function']['name'], "
    "'arguments': call['function']['arguments']} | tojson }}</call>{% endfor %}{% endif %}<|endoftext|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

RESPONSE_TEMPLATE: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>",
    "fields": {
        "tool_calls": {"open": "<call>", "close_pattern": r"</call>", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<\|endoftext\|>", "content": "text"},
    },
}


def with_tools(tokenizer: Any) -> Any:
    """``tokenizer`` (the tiny default's) rendering and parsing tool calls; returned for chaining."""
    tokenizer.chat_template = TOOLS_CHAT_TEMPLATE
    tokenizer.response_template = RESPONSE_TEMPLATE
    return tokenizer
