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


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=new_call_id)

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
    """Splits a streamed answer into OpenAI deltas. Content streams as it comes, except text that may open a call.
    Each call goes out as a first delta with its index, id, type and name, then deltas of its arguments: Hermes
    calls as their arguments arrive (once the name is known), Llama 3 calls whole, once each is complete."""

    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self.num_calls = 0
        self._buf = ""     # text not sent yet (content mode), or everything from the first call on (calls mode)
        self._mode = "undecided" if isinstance(fmt, Llama3Format) else "content"
        self._calls: list[_OpenCall] = []  # Hermes: per <tool_call> block, what has been sent of it

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
        if isinstance(self.fmt, HermesFormat):
            return deltas + self._hermes_calls(final)
        content, calls = self.fmt._split(self._buf)
        for call in (calls if final else calls[:-1])[self.num_calls:]:  # a call is whole once text follows it
            deltas += self._whole_call(call)
        if final:
            rest = self._buf if not calls else content
            if rest.strip():
                deltas.append({"content": rest})  # text that opened like a call but never became one
        return deltas

    def _whole_call(self, call: ToolCall) -> list[dict]:
        deltas = [self._header(call.id, call.name), self._arguments(self.num_calls, call.arguments)]
        self.num_calls += 1
        return deltas

    def _header(self, call_id: str, name: str) -> dict:
        return {"tool_calls": [{"index": self.num_calls, "id": call_id, "type": "function",
                                "function": {"name": name, "arguments": ""}}]}

    @staticmethod
    def _arguments(index: int, text: str) -> dict:
        return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}

    def _hermes_calls(self, final: bool) -> list[dict]:
        deltas: list[dict] = []
        blocks = self._buf.split("<tool_call>")[1:]  # the buffer starts with the first <tool_call>
        for k, block in enumerate(blocks):
            if k == len(self._calls):
                self._calls.append(_OpenCall())
            call = self._calls[k]
            body, closed = block.partition("</tool_call>")[0], "</tool_call>" in block
            if call.index is None and (m := _HERMES_HEAD.match(body)) is not None:
                call.index, call.args_start = self.num_calls, m.end()
                deltas.append(self._header(new_call_id(), json.loads(f'"{m.group(1)}"')))
                self.num_calls += 1
            if call.index is not None:
                args = call.scan(body)  # the arguments' text so far (all of it once their JSON closes)
                if len(args) > call.sent:
                    deltas.append(self._arguments(call.index, args[call.sent:]))
                    call.sent = len(args)
            elif closed or final:  # keys in another order: parse the whole block
                try:
                    whole = _call_from_json(json.loads(body), "arguments")
                except ValueError:
                    whole = None
                if whole is not None and not call.whole:
                    call.whole = True
                    deltas += self._whole_call(whole)
        if final:
            rest = "".join(b.partition("</tool_call>")[2] if c.index is not None or c.whole else "<tool_call>" + b
                           for b, c in zip(blocks, self._calls))
            if rest.strip():
                deltas.append({"content": rest})  # text between calls, or a block that never became a call
        return deltas

    def _partial_start_len(self) -> int:
        """How many trailing characters could be the beginning of a call's opening text."""
        start = self.fmt.start
        for n in range(min(len(start) - 1, len(self._buf)), 0, -1):
            if start.startswith(self._buf[-n:]):
                return n
        return 0


# A Hermes call's JSON up to its arguments' object: {"name": "...", "arguments": (followed by "{")
_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')


class _OpenCall:
    """One streamed <tool_call> block: its call index once its name is known, and a resumable scan of its arguments'
    JSON (string- and escape-aware bracket depth) that finds where the arguments end without re-reading them."""

    def __init__(self):
        self.index: int | None = None
        self.whole = False     # sent whole, parsed at its end (its keys came in another order)
        self.args_start = 0    # where the arguments' value starts in the block
        self.sent = 0          # characters of the arguments already sent
        self._pos = 0          # scan position, relative to args_start
        self._depth = 0
        self._in_string = self._escaped = False
        self._end: int | None = None  # length of the arguments' text once it is closed

    def scan(self, body: str) -> str:
        text = body[self.args_start:]
        while self._end is None and self._pos < len(text):
            c = text[self._pos]
            self._pos += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    self._end = self._pos
        return text[:self._end] if self._end is not None else text
