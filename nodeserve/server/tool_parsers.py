"""Tool-call formats: find a model's tool calls in its text (whole, or as it streams), and write calls back as
the model writes them (for templates without tool support, and for the grammar that forces a call).

Two formats, as vLLM names them:
  hermes  (Hermes, Qwen 2/2.5/3, and nodeserve's fallback prompt):  <tool_call>{"name": ..., "arguments": {...}}</tool_call>
  llama3  (Llama 3.1+ JSON tool calling):  {"name": ..., "parameters": {...}}, calls separated by ";"
Hand-written: vLLM's parsers are the reference, but they live inside vLLM and need its whole package.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call_from_json(obj: object, args_key: str) -> ToolCall | None:
    """A call from a parsed JSON object, if it is one: {"name": str, args_key (or the other key): object}."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolFormat:
    """One model family's tool-call syntax. Subclasses set the class attributes and `_split`."""

    name: str
    args_key: str    # the key that holds the arguments in one call's JSON
    prefix: str      # text before each call's JSON
    suffix: str      # text after it
    start: str       # text that opens the tool-call part of an answer (held back while streaming)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) from a whole answer; text that does not parse as calls stays content."""
        content, calls = self._split(text)
        return (content if content.strip() else None) if calls else text, calls

    def _split(self, text: str) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    def render_call(self, name: str, arguments: dict | str) -> str:
        """One call as the model would write it (arguments as given in an OpenAI history message)."""
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        return self.prefix + json.dumps({"name": name, self.args_key: arguments}, ensure_ascii=False) + self.suffix

    def call_schema(self, name: str, parameters: dict | None) -> dict:
        """JSON schema of one call's JSON to `name`: what the grammar forces for a named or required tool_choice."""
        return {"type": "object", "properties": {"name": {"const": name},
                                                 self.args_key: parameters or {"type": "object"}},
                "required": ["name", self.args_key], "additionalProperties": False}

    def streamer(self) -> ToolStreamer:
        return ToolStreamer(self)


class HermesFormat(ToolFormat):
    name, args_key, prefix, suffix, start = "hermes", "arguments", "<tool_call>\n", "\n</tool_call>", "<tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def _split(self, text: str) -> tuple[str, list[ToolCall]]:
        calls, rest, end = [], [], 0
        for m in self._CALL.finditer(text):
            try:
                call = _call_from_json(json.loads(m.group(1)), self.args_key)
            except ValueError:
                call = None
            if call is None:
                continue  # not a call after all: its text stays content
            rest.append(text[end:m.start()])
            end = m.end()
            calls.append(call)
        rest.append(text[end:])
        return "".join(rest), calls


class Llama3Format(ToolFormat):
    name, args_key, prefix, suffix, start = "llama3", "parameters", "", "", "{"
    _DECODER = json.JSONDecoder()

    def _split(self, text: str) -> tuple[str, list[ToolCall]]:
        # The whole answer is calls or none is: Llama 3 starts a tool answer with the JSON (after <|python_tag|>).
        body = text.strip().removeprefix("<|python_tag|>").lstrip()
        calls, i = [], 0
        while i < len(body):
            try:
                obj, i = self._DECODER.raw_decode(body, i)
            except ValueError:
                return text, []
            call = _call_from_json(obj, self.args_key)
            if call is None:
                return text, []
            calls.append(call)
            while i < len(body) and body[i] in " \t\r\n;":
                i += 1
        return "", calls


FORMATS: dict[str, type[ToolFormat]] = {"hermes": HermesFormat, "llama3": Llama3Format}


def pick_format(name: str, template: str) -> ToolFormat | None:
    """model.tool_parser: "hermes", "llama3", "none", or "auto": the chat template's own format when it writes one
    (Hermes/Qwen templates write <tool_call>, Llama 3's <|python_tag|> or "parameters"), else hermes, the format
    nodeserve's fallback tool prompt asks for."""
    if name == "none":
        return None
    if name != "auto":
        return FORMATS[name]()
    if "<tool_call>" not in template and ("<|python_tag|>" in template or "<|eom_id|>" in template):
        return Llama3Format()
    return HermesFormat()


class ToolStreamer:
    """Splits a streamed answer into OpenAI deltas: content streams as it comes, except text that may open a call,
    which is held until a whole call has been seen; each call then goes out as a first delta with its id, type and
    name, then one with its arguments."""

    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self.num_calls = 0
        self._buf = ""     # text not sent yet: calls, or content that may be the start of one
        self._mode = "undecided" if isinstance(fmt, Llama3Format) else "content"

    def feed(self, text: str, final: bool = False) -> list[dict]:
        """Deltas (each a chat chunk's `delta`) for the next piece of text; final: the answer ended."""
        self._buf += text
        deltas: list[dict] = []
        if self._mode == "undecided":  # Llama 3: the answer's first characters say whether it is calls
            head = self._buf.lstrip()
            if head:
                self._mode = "calls" if head.startswith(("{", "<|python_tag|>")) else "content"
            elif not final:
                return deltas
        if self._mode == "content":
            at = self._buf.find(self.fmt.start) if isinstance(self.fmt, HermesFormat) else -1
            if at < 0:
                keep = 0 if final else self._partial_start_len()
                out, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                return [{"content": out}] if out else []
            if self._buf[:at]:
                deltas.append({"content": self._buf[:at]})
            self._buf, self._mode = self._buf[at:], "calls"
        content, calls = self.fmt._split(self._buf)
        for call in (calls if final else self._complete(calls))[self.num_calls:]:
            deltas.append({"tool_calls": [{"index": self.num_calls, "id": call.id, "type": "function",
                                           "function": {"name": call.name, "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": self.num_calls, "function": {"arguments": call.arguments}}]})
            self.num_calls += 1
        if final:
            rest = self._buf if not calls else content
            if rest.strip():
                deltas.append({"content": rest})  # text that opened like a call but never became one
        return deltas

    def _partial_start_len(self) -> int:
        """How many trailing characters could be the beginning of a call's opening text."""
        start = self.fmt.start
        for n in range(min(len(start) - 1, len(self._buf)), 0, -1):
            if start.startswith(self._buf[-n:]):
                return n
        return 0

    def _complete(self, calls: list[ToolCall]) -> list[ToolCall]:
        """The calls whose text is closed, so no later text can change them."""
        if isinstance(self.fmt, HermesFormat):
            return calls[:self._buf.count("</tool_call>")]
        # Llama 3: a call is closed once more text follows its JSON (a ";" or the next call); the last one at the end.
        return calls[:-1]
