"""Tool-call formats: find a model's tool calls in its text (whole, or as it streams), and write calls back as
the model writes them (for templates without tool support, and for the grammar that forces a call).

Two formats, as vLLM names them:
  hermes  (Hermes, Qwen 2/2.5/3, and nodeserve's fallback prompt):  <tool_call>{"name": ..., "arguments": {...}}</tool_call>
  llama3  (Llama 3.1+ JSON tool calling):  {"name": ..., "parameters": {...}}, calls separated by ";"
Hand-written: vLLM's parsers are the reference, but they live inside vLLM and need its whole package.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

_OPEN, _CLOSE, _PYTHON_TAG = "<tool_call>", "</tool_call>", "<|python_tag|>"


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

    def _split(self, text: str) -> tuple[str, list[ToolCall]]:
        # Each block runs from <tool_call> to the first </tool_call> after it, or to the end. Found with str.find,
        # not a regex: r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)" took time quadratic in a whitespace run inside a
        # block, and this runs on the event loop. str.strip drops what the regex's \s* did (the same characters).
        calls, rest, end, i = [], [], 0, 0
        while (at := text.find(_OPEN, i)) >= 0:
            close = _close_of(text, at + len(_OPEN))
            body_end, i = (close, close + len(_CLOSE)) if close >= 0 else (len(text), len(text))
            try:
                call = _call_from_json(json.loads(text[at + len(_OPEN):body_end].strip()), self.args_key)
            except (ValueError, RecursionError):  # RecursionError: nested deeper than the decoder goes
                call = None
            if call is None:
                continue  # not a call after all: its text stays content
            rest.append(text[end:at])
            end = i
            calls.append(call)
        rest.append(text[end:])
        return "".join(rest), calls


def _close_of(text: str, start: int) -> int:
    """Where the block whose text starts at `start` closes: the first </tool_call> after its JSON, when the block
    opens with JSON (a string inside may hold "</tool_call>" itself); -1 if it does not close (its JSON stays open)."""
    body = start
    while body < len(text) and text[body].isspace():
        body += 1
    if body < len(text) and text[body] in "{[":
        json_end = _JsonEnd(body).scan(text, len(text))
        return -1 if json_end is None else text.find(_CLOSE, json_end)
    return text.find(_CLOSE, start)


class Llama3Format(ToolFormat):
    name, args_key, prefix, suffix, start = "llama3", "parameters", "", "", "{"
    _DECODER = json.JSONDecoder()

    def _split(self, text: str) -> tuple[str, list[ToolCall]]:
        # The whole answer is calls or none is: Llama 3 starts a tool answer with the JSON (after <|python_tag|>).
        body = text.strip().removeprefix(_PYTHON_TAG).lstrip()
        calls, i = [], 0
        while i < len(body):
            try:
                obj, i = self._DECODER.raw_decode(body, i)
            except (ValueError, RecursionError):
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
    calls as their arguments arrive (once the name is known), Llama 3 calls whole, once each is complete.
    A piece costs time in its own length, not the answer's: every scan resumes where the last piece left it."""

    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self.num_calls = 0
        self._buf = ""     # text not sent yet (content mode), or everything from the first call on (calls mode)
        self._mode = "undecided" if isinstance(fmt, Llama3Format) else "content"
        self._calls: list[_OpenCall] = []  # Hermes: per <tool_call> block, what has been sent of it
        self._open_from = 0                # Hermes: where the next <tool_call> may start
        self._llama3 = _Llama3Scan(fmt.args_key)

    def feed(self, text: str, final: bool = False) -> list[dict]:
        """Deltas (each a chat chunk's `delta`) for the next piece of text; final: the answer ended."""
        # Appended through a local holding the only reference, which CPython extends in place; `self._buf +=
        # text` would copy the whole answer so far on every piece (quadratic in a long call's arguments).
        buf, self._buf = self._buf, ""
        buf += text
        self._buf = buf
        del buf
        deltas: list[dict] = []
        if self._mode == "undecided":  # Llama 3: the answer's first characters say whether it is calls
            head = text.lstrip()  # what came before was whitespace, or the mode would be decided
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
        # Llama 3: what `_split` finds in the whole text, found piece by piece; its calls are all or nothing.
        calls = self._llama3.calls if self._llama3.advance(self._buf) else []
        for call in (calls if final else calls[:-1])[self.num_calls:]:  # a call is whole once text follows it
            deltas += self._whole_call(call)
        if final and not calls and self._buf.strip():
            deltas.append({"content": self._buf})  # text that opened like a call but never became one
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
        buf = self._buf  # starts with the first <tool_call>
        changed = max(len(self._calls) - 1, 0)  # blocks before the last one are as the last piece left them
        while (at := buf.find(_OPEN, self._open_from)) >= 0:
            if self._calls:
                self._calls[-1].stop = at
            self._calls.append(_OpenCall(at + len(_OPEN)))
            self._open_from = at + len(_OPEN)
        self._open_from = max(self._open_from, len(buf) - len(_OPEN) + 1)  # an opening may end in the next piece
        deltas: list[dict] = []
        for call in self._calls if final else self._calls[changed:]:  # the end may complete any block
            call.extend(buf)
            if call.index is None and (name := call.head(buf)) is not None:
                call.index = self.num_calls
                deltas.append(self._header(new_call_id(), name))
                self.num_calls += 1
            if call.index is not None:
                if args := call.new_arguments(buf):  # the arguments' text so far (all of it once their JSON closes)
                    deltas.append(self._arguments(call.index, args))
            elif (call.closed or final) and not call.parsed:  # keys in another order: parse the whole block, once
                call.parsed = True
                try:
                    whole = _call_from_json(json.loads(buf[call.start:call.end]), "arguments")
                except (ValueError, RecursionError):
                    whole = None
                if whole is not None:
                    call.whole = True
                    deltas += self._whole_call(whole)
        if final:
            rest = "".join((buf[c.end + len(_CLOSE):c.stop] if c.closed else "") if c.index is not None or c.whole
                           else buf[c.start - len(_OPEN):c.stop] for c in self._calls)
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


class _JsonEnd:
    """Where the JSON object (or array) that opens at `pos` closes: a string- and escape-aware bracket depth,
    resumable, so that text that grows is read once."""

    def __init__(self, pos: int):
        self.pos = pos
        self.end: int | None = None  # just past the closing bracket, once read
        self._depth = 0
        self._in_string = self._escaped = False

    def scan(self, text: str, stop: int) -> int | None:
        """Reads on up to `stop`; the end once found."""
        while self.end is None and self.pos < stop:
            c = text[self.pos]
            self.pos += 1
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
                    self.end = self.pos
        return self.end


# A Hermes call's JSON up to its arguments' object, {"name": "...", "arguments": then "{", as the steps of a scan:
# "" a run of whitespace (str.isspace: the characters of regex \s), None the name's string after its opening quote.
# It was the regex r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)', matched again
# on the whole block for every piece: time quadratic in a long name or whitespace run.
_HEAD = ("", "{", "", '"name"', "", ":", "", '"', None, "", ",", "", '"arguments"', "", ":", "", "{")


class _OpenCall:
    """One streamed <tool_call> block, by offsets into the stream's text: its call index once its name is known,
    and resumable scans of its head and of its arguments' JSON, so no piece makes the block be read again."""

    def __init__(self, start: int):
        self.start = start            # where the block's text starts, after <tool_call>
        self.stop: int | None = None  # where it ends (the next <tool_call>); None while it is the last block
        self.end = start              # where its body ends: at its first </tool_call>, else (so far) with it
        self.closed = False
        self.index: int | None = None
        self.whole = False            # sent whole, parsed at its end (its keys came in another order)
        self.parsed = False           # parsed whole already (its body ends there: it is closed, or the answer is)
        self._close_from = start      # where a </tool_call> may start
        self._body_from = start       # where the block's JSON may start (past leading whitespace)
        self._body: _JsonEnd | None = None  # the block's own JSON: a </tool_call> inside its strings does not close it
        self._plain = False           # the block does not open with JSON: the first </tool_call> closes it
        self._step = self._char = 0   # the head scan: step of _HEAD (-1: not this head, ever), character of a literal
        self._pos = start
        self._escaped = False
        self._name_start = self._name_end = 0
        self._args: _JsonEnd | None = None
        self._sent = 0                # where the arguments' text sent so far ends

    def extend(self, buf: str) -> None:
        """Moves the body's end up to what `buf` now holds of the block."""
        if self.closed:
            return
        stop = len(buf) if self.stop is None else self.stop
        if not self._plain and self._body is None:
            while self._body_from < stop and buf[self._body_from].isspace():
                self._body_from += 1
            if self._body_from < stop:
                self._plain = buf[self._body_from] not in "{["
                self._body = None if self._plain else _JsonEnd(self._body_from)
        if self._body is not None and self._body.end is None:
            if self._body.scan(buf, stop) is None:
                self.end = stop  # its JSON is still open: no </tool_call> so far closes it
                return
            self._close_from = max(self._close_from, self._body.end)
        close = buf.find(_CLOSE, self._close_from, stop)
        if close >= 0:
            self.closed, self.end = True, close
        else:
            self.end, self._close_from = stop, max(self._close_from, stop - len(_CLOSE) + 1)

    def head(self, buf: str) -> str | None:
        """The call's name once its head has come whole (the arguments start at the "{" after it), else None."""
        while self._step >= 0 and self._pos < self.end:
            c, step = buf[self._pos], _HEAD[self._step]
            if step == "":
                if c.isspace():
                    self._pos += 1
                else:
                    self._step += 1
            elif step is None:
                self._pos += 1
                if self._escaped:
                    self._escaped = False
                    if c == "\n":
                        self._step = -1  # as the regex's \\. did: a backslash escapes anything but a newline
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._name_end, self._step = self._pos - 1, self._step + 1
            elif c != step[self._char]:
                self._step = -1  # keys in another order, or not JSON: the block is parsed whole at its end
            elif self._step == len(_HEAD) - 1:  # the arguments' "{", left for their scan
                try:
                    name = json.loads(f'"{buf[self._name_start:self._name_end]}"')
                except ValueError:
                    self._step = -1  # a name JSON cannot read: no head (nor a call, parsed whole)
                    return None
                self._args, self._sent = _JsonEnd(self._pos), self._pos
                return name
            else:
                self._pos, self._char = self._pos + 1, self._char + 1
                if self._char == len(step):
                    self._step, self._char = self._step + 1, 0
                    if _HEAD[self._step] is None:
                        self._name_start = self._pos
        return None

    def new_arguments(self, buf: str) -> str:
        """The arguments' text that came since the last call (up to where their JSON closes, once it does)."""
        end = self._args.scan(buf, self.end)
        upto = self.end if end is None else min(end, self.end)
        new, self._sent = buf[self._sent:upto], max(self._sent, upto)
        return new


class _Llama3Scan:
    """`Llama3Format._split` over a text that grows, resumable: the calls so far, and where the next one starts.
    An object is decoded once its brackets close, not before. An item that does not start with "{", does not decode
    or is no call stays so however the text goes on: the answer is then not calls, for good."""

    def __init__(self, args_key: str):
        self.args_key = args_key
        self.calls: list[ToolCall] = []
        self.failed = False
        self._pos: int | None = None     # where the next call's JSON (or the separators before it) starts
        self._item: _JsonEnd | None = None  # the call whose JSON is open
        self._blank_to = 0               # the text from _pos is whitespace up to here

    def advance(self, text: str) -> bool:
        """Reads on in `text`; whether all of it is calls (and separators), as `_split` would say."""
        if self._pos is None:  # `_split`: text.strip().removeprefix("<|python_tag|>").lstrip()
            start = len(text) - len(text.lstrip())
            if start == len(text):
                return True  # only whitespace yet: an answer that ended before it began
            self._pos = start + len(_PYTHON_TAG) if text.startswith(_PYTHON_TAG, start) else start
        while not self.failed:
            if self._item is None:
                while self._pos < len(text) and (text[self._pos] in " \t\r\n;" if self.calls
                                                 else text[self._pos].isspace()):
                    self._pos += 1
                if self._pos == len(text):
                    return True
                if text[self._pos] != "{":
                    # Whitespace may end the text (`_split` strips it); anything else is not a call, ever.
                    blank_from, self._blank_to = max(self._pos, self._blank_to), len(text)
                    if not text[blank_from:].strip():
                        return True
                    self.failed = True
                    break
                self._item = _JsonEnd(self._pos)
            if self._item.scan(text, len(text)) is None:
                return False  # an object still open
            try:
                obj, self._pos = Llama3Format._DECODER.raw_decode(text, self._pos)
            except (ValueError, RecursionError):
                obj = None
            self._item = None
            call = _call_from_json(obj, self.args_key)
            if call is None:
                self.failed = True
                break
            self.calls.append(call)
        return False
