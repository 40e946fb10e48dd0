"""The tiny default's chat template with tools: the same text as its plain template where no tools, tool
calls or tool results appear, else tools listed in a system turn, the calls as ``<call>[name(key=value, ...)]</call>``
in the assistant's turn and each result as a ``tool`` turn; and the response template that parses those calls
(transformers' response parsing, which TRL's ``parse_response`` reads)."""

from __future__ import annotations

from typing import Any

TOOLS_CHAT_TEMPLATE = (
    "{% if tools %}<|system|>tools:{% for tool in tools %} {{ tool['function']['name'] }}"
    "{% endfor %}<|endoftext|>{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}"
    "{% if message['tool_calls'] %}<call>[{% for call in message['tool_calls'] %}{{ call['function']['name'] }}("
    "{% for key, value in call['function']['arguments'].items() %}{{ key }}={{ value | tojson }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}){% if not loop.last %}, {% endif %}{% endfor %}]</call>"
    "{% endif %}<|endoftext|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

RESPONSE_TEMPLATE: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>",
    "fields": {
        "tool_calls": {"open": "<call>", "close_pattern": r"</call>", "content": "python-call-list",
                       "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{arguments}"}},
                       "transform_each": True},
        "content": {"close_pattern": r"<\|endoftext\|>", "content": "text"},
    },
}


def with_tools(tokenizer: Any) -> Any:
    """``tokenizer`` (the tiny default's) rendering and parsing tool calls; returned for chaining."""
    tokenizer.chat_template = TOOLS_CHAT_TEMPLATE
    tokenizer.response_template = RESPONSE_TEMPLATE
    return tokenizer
