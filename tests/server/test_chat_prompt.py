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
