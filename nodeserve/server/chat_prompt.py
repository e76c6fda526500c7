"""The prompt text of a chat request: messages and tools through the model's chat template.

A template that renders `tools` itself gets them as transformers passes them (the OpenAI function dicts), and
history tool calls with their arguments as objects (Qwen's and Llama 3's templates write them with `tojson`). A
template without tool support (SmolLM2's) gets nodeserve's fallback instead: a system message that lists the
tools and asks for calls in the parser's format, assistant tool calls written out in that format, and tool
results wrapped in <tool_response> tags, the way Hermes-style templates show them.
"""

from __future__ import annotations

import json

from nodeserve.server.tool_parsers import ToolFormat
from nodeserve.tokenizer import Tokenizer

FALLBACK_TOOL_PROMPT = (
    "You can call functions. The functions you may call are listed as JSON schemas in <tools></tools>:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with {example} for each call, and nothing else.")


def render_chat(tok: Tokenizer, messages: list[dict], tools: list[dict], fmt: ToolFormat | None,
                extra: dict, add_generation_prompt: bool = True) -> str:
    """The prompt text for `messages`, with `tools` described to the model (none: tool_choice "none")."""
    if tok.template_has_tools or fmt is None:
        return tok.apply_chat_template([_with_object_arguments(m) for m in messages], add_generation_prompt,
                                       tools=tools or None, extra=extra)
    messages = [_as_text(m, fmt) for m in messages]
    if tools:
        listed = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
        example = fmt.render_call("<function-name>", {"<argument-name>": "<value>"})
        system = FALLBACK_TOOL_PROMPT.format(tools=listed, example=example)
        if messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + system}
        else:
            messages.insert(0, {"role": "system", "content": system})
    return tok.apply_chat_template(messages, add_generation_prompt, extra=extra)


def _with_object_arguments(message: dict) -> dict:
    """OpenAI sends a call's arguments as JSON text; templates expect the object (vLLM converts them too)."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        fn = call["function"]
        try:
            args = json.loads(fn["arguments"])
        except ValueError:
            args = fn["arguments"]
        calls.append({**call, "function": {**fn, "arguments": args}})
    return {**message, "tool_calls": calls}


def _as_text(message: dict, fmt: ToolFormat) -> dict:
    """A tool-call turn or a tool result as plain text, for templates that render only role and content."""
    if message["role"] == "tool":
        return {"role": "tool", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    if not message.get("tool_calls"):
        return message
    calls = [fmt.render_call(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    text = "\n".join(([message["content"]] if message.get("content") else []) + calls)
    return {"role": message["role"], "content": text}
