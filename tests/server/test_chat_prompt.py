"""server/chat_prompt.py: tools and tool-call history through a template with tool support, and through
nodeserve's fallback for one without (the bundled SmolLM2's)."""

from __future__ import annotations

import json

from nodeserve.server.chat_prompt import render_chat
from nodeserve.server.tool_parsers import HermesFormat, Llama3Format
from nodeserve.tokenizer import Tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
]

# The shape of Qwen 2.5's tool handling, cut down: tools listed in the system turn, calls written with tojson.
QWEN_LIKE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{{ greeting | default('') }}")


def _with_template(tok: Tokenizer, template: str) -> Tokenizer:
    t = Tokenizer.__new__(Tokenizer)
    t.__dict__.update(tok.__dict__)
    t.chat_template, t._template = template, None
    return t


def test_fallback_lists_the_tools_and_renders_the_history(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert not tok.template_has_tools
    text = render_chat(tok, HISTORY, TOOLS, HermesFormat(), {})
    assert "<tools>\n" + json.dumps(TOOLS[0]["function"]) + "\n</tools>" in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' \
           '</tool_call><|im_end|>' in text
    assert "<|im_start|>tool\n<tool_response>\n18 C\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # A system message of the request's own keeps its text, the tools follow it.
    text = render_chat(tok, [{"role": "system", "content": "Be brief."}] + HISTORY, TOOLS, Llama3Format(), {})
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou can call functions.")
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in text


def test_fallback_without_tools_still_renders_tool_history(smollm2_tokenizer):
    text = render_chat(smollm2_tokenizer, HISTORY, [], HermesFormat(), {})
    assert "<tools>" not in text and "<tool_response>\n18 C" in text


def test_template_with_tools_gets_them_as_transformers_passes_them(smollm2_tokenizer):
    tok = _with_template(smollm2_tokenizer, QWEN_LIKE)
    assert tok.template_has_tools
    text = render_chat(tok, HISTORY, TOOLS, HermesFormat(), {"greeting": "Hi"})
    assert text.startswith("<|im_start|>system\n<tools>" + json.dumps(TOOLS[0]) + "</tools>")
    # The call's arguments reach the template as an object, as vLLM passes them.
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert text.endswith("<|im_start|>assistant\nHi")  # chat_template_kwargs reach the template
    assert "<tools>" not in render_chat(tok, HISTORY, [], HermesFormat(), {})


# What Qwen3's template adds to Qwen 2.5's, cut down: a namespace found by walking the messages backwards with
# string methods, consecutive tool results grouped into one user turn, and enable_thinking from
# chat_template_kwargs (its empty think block when thinking is off).
QWEN3_LIKE = (
    "{% set ns = namespace(last_query=messages|length - 1) %}"
    "{% for m in messages[::-1] %}{% if m.role == 'user' and not m.content.startswith('<tool_response>') "
    "and ns.last_query == messages|length - 1 %}{% set ns.last_query = (messages|length - 1) - loop.index0 %}"
    "{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}{% if messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
    "{% if tools %}{{ tools | length }} tools{% endif %}")


def test_qwen3_style_template_renders_tool_turns_and_thinking_switch(smollm2_tokenizer):
    tok = _with_template(smollm2_tokenizer, QWEN3_LIKE)
    history = HISTORY + [{"role": "tool", "tool_call_id": "call_1", "content": "dry"}]
    text = render_chat(tok, history, TOOLS, HermesFormat(), {"enable_thinking": False})
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\ndry\n</tool_response>" \
           "<|im_end|>" in text  # two results, one turn
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n1 tools")
    assert "<think>" not in render_chat(tok, history, TOOLS, HermesFormat(), {})
    # what a Qwen3 model answers with parses as a call
    assert HermesFormat().parse('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
                                '</tool_call>')[1][0].name == "get_weather"
