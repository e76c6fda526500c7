"""Tokenizer: text <-> token ids, chat-template rendering and streaming detokenization for one model."""

from __future__ import annotations

import functools
import json
import os
import re
import struct
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import sentencepiece
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers


class TokenizerError(ValueError):
    """The checkpoint's tokenizer can't be loaded."""


class TemplateError(ValueError):
    """The chat template failed to render; the message is shown to API users."""


# Used when a checkpoint ships no template, as HF did by default.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Chat models end a turn with their own marker, which often isn't the configured EOS
# (Llama 3's <|eot_id|>, Gemma's <end_of_turn>). If the template writes one, it ends generation.
_END_OF_TURN_MARKERS = (
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>",
    "<|endoftext|>", "<|end_of_text|>", "<｜end▁of▁sentence｜>", "<EOT>",
)

# GGUF token types: llama.cpp's llama_token_type, numbered like SentencePiece's piece types.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer regexes from llama.cpp's llama-vocab.cpp, keyed by tokenizer.ggml.pre.
# Each list is applied in order, every regex splitting the pieces the previous one left.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's "llama3" pre-tokenizer family also looks whole words up before merging, and adds BOS by default.
_LLAMA3_PRES = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2")
_PRE_SPLITS = {
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
                    [r"\p{N}", _GPT2_SPLIT]),
    **dict.fromkeys(_LLAMA3_PRES + ("dbrx", "smaug-bpe"), [_LLAMA3_SPLIT]),
    **dict.fromkeys(("qwen2", "stablelm2", "deepseek-r1-qwen", "hunyuan", "megrez"), [_QWEN2_SPLIT]),
}

# How many prompt tokens seed the detokenizer, so the first output token decodes in context (vLLM uses 5).
_DETOKENIZE_CONTEXT = 5


class Tokenizer:
    """One model's vocabulary, special ids and chat template. Build it with from_gguf_metadata or from_hf_dir."""

    def __init__(self, backend: _TokenizersBackend | _SentencePieceBackend, *, bos_token_id: int | None,
                 eos_ids: Iterable[int | None], add_bos: bool, chat_template: str | None):
        self._backend = backend
        self.vocab_size: int = backend.vocab_size
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._bos_token = backend.special_text(bos_token_id)
        eos_ids = [i for i in eos_ids if isinstance(i, int) and 0 <= i < self.vocab_size]
        self._eos_token = backend.special_text(eos_ids[0]) if eos_ids else ""
        ends = set(eos_ids)
        for marker in _END_OF_TURN_MARKERS:
            if marker in (chat_template or CHATML_TEMPLATE):
                marker_id = backend.token_to_id(marker)
                if marker_id is not None:
                    ends.add(marker_id)
        self.eos_token_ids: frozenset[int] = frozenset(ends)
        self._template: jinja2.Template | None = None

    # ---- loading ----

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], default_template: str | None = None) -> Tokenizer:
        """default_template: the chat template when the file carries none (its architecture's, model/registry.py)."""
        kind = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if kind not in ("gpt2", "llama"):
            raise TokenizerError(f"unsupported GGUF tokenizer model {kind!r} (supported: gpt2, llama)")
        if not tokens:
            raise TokenizerError("GGUF metadata has no tokenizer.ggml.tokens")
        types = list(meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
        pre = meta.get("tokenizer.ggml.pre") or "default"
        if kind == "gpt2":
            backend = _byte_level_bpe(tokens, types, meta.get("tokenizer.ggml.merges") or [], pre)
        else:
            scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
            backend = _sentencepiece_from_vocab(tokens, scores, types,
                                                meta.get("tokenizer.ggml.add_space_prefix", True))
        eos_ids = [meta.get(f"tokenizer.ggml.{key}") for key in ("eos_token_id", "eot_token_id", "eom_token_id")]
        # llama.cpp's defaults when the file doesn't say: SentencePiece vocabularies add BOS, most BPE ones don't.
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama" or pre in _LLAMA3_PRES))
        return cls(backend, bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_ids=eos_ids,
                   add_bos=add_bos, chat_template=meta.get("tokenizer.chat_template") or default_template)

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike, default_template: str | None = None) -> Tokenizer:
        path = Path(path)
        config = _read_json(path / "tokenizer_config.json")
        if (path / "tokenizer.json").is_file():
            try:
                backend = _TokenizersBackend(tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")))
            except Exception as e:
                raise TokenizerError(f"can't load {path / 'tokenizer.json'}: {e}") from e
        elif (path / "tokenizer.model").is_file():
            backend = _sentencepiece_from_file(path / "tokenizer.model", config.get("added_tokens_decoder") or {})
        else:
            raise TokenizerError(f"no tokenizer.json or tokenizer.model in {path}")

        model_config = _read_json(path / "config.json")
        generation_config = _read_json(path / "generation_config.json")
        bos_candidates = (backend.token_to_id(_token_content(config.get("bos_token"))),
                          model_config.get("bos_token_id"), backend.default_bos_id())
        bos_id = next((i for i in bos_candidates if i is not None), None)
        eos_ids = [backend.token_to_id(_token_content(config.get("eos_token"))), backend.default_eos_id()]
        for cfg in (generation_config, model_config):
            ids = cfg.get("eos_token_id")
            eos_ids += ids if isinstance(ids, list) else [ids]

        if "add_bos_token" in config:
            add_bos = bool(config["add_bos_token"])
        else:
            add_bos = backend.adds_bos_by_default(bos_id)
        return cls(backend, bos_token_id=bos_id, eos_ids=eos_ids, add_bos=add_bos,
                   chat_template=_hf_chat_template(path, config) or default_template)

    # ---- text <-> ids ----

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = self._backend.encode(text)
        if add_bos is None:
            add_bos = self.add_bos
        # Templates that write BOS themselves (Llama 3) would otherwise get it twice.
        if add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self._backend.token_text(token_id)

    def token_bytes(self) -> list[bytes]:
        """Each token's bytes as it writes them into text, by id (what a grammar matcher checks tokens against);
        b"" for special tokens, which never appear inside text."""
        return self._backend.token_bytes()

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token's text has: a text of n characters is at least n / this many tokens,
        so a prompt far over the context can be refused without tokenizing it."""
        return max(1, max((len(self.token_text(i)) for i in range(self.vocab_size)), default=1))

    # ---- chat ----

    @property
    def template_source(self) -> str:
        return self.chat_template or CHATML_TEMPLATE

    @property
    def template_has_tools(self) -> bool:
        """Whether the chat template renders a `tools` list itself (else the caller describes the tools)."""
        return "tools" in self.template_source

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, extra: dict[str, Any] | None = None) -> str:
        """Renders like transformers' apply_chat_template: `tools` (OpenAI-style function dicts) and `extra`
        (chat_template_kwargs) become template variables; `extra` may not replace messages or tools."""
        template = self._compiled_template()
        messages = [_flatten_message(m) for m in messages]
        try:
            return template.render(**{**(extra or {}), "messages": messages, "tools": tools,
                                      "add_generation_prompt": add_generation_prompt,
                                      "bos_token": self._bos_token, "eos_token": self._eos_token})
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template failed to render: {e}") from e
        except Exception as e:  # templates index, add and call whatever the request sent
            raise TemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from e

    def _compiled_template(self) -> jinja2.Template:
        if self._template is None:
            try:
                self._template = _jinja_env().from_string(self.template_source)
            except jinja2.TemplateSyntaxError as e:
                raise TemplateError(f"invalid chat template (line {e.lineno}): {e.message}") from e
        return self._template


class IncrementalDetokenizer:
    """Streaming detokenizer: never emits broken UTF-8, handles characters spanning several tokens.

    vLLM's prefix_offset/read_offset scheme: decode a short window of trailing tokens twice, without and
    with the new ones, and emit the difference unless it ends in U+FFFD (a character still incomplete).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # The prompt's tail is context only: it makes e.g. a SentencePiece "▁Hello" decode as " Hello".
        self._ids = list(prompt_ids)[-_DETOKENIZE_CONTEXT:]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._text = ""

    @property
    def text(self) -> str:
        return self._text

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        skip = self._skip_special_tokens
        prefix = self._tokenizer.decode(self._ids[self._prefix_offset:self._read_offset], skip)
        full = self._tokenizer.decode(self._ids[self._prefix_offset:], skip)
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        new = full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._text += new
        return new


# ---- backends ----

class _TokenizersBackend:
    """A `tokenizers` pipeline: byte-level BPE from GGUF, or any tokenizer.json."""

    def __init__(self, tk: tokenizers.Tokenizer):
        self.tk = tk
        self.vocab_size = tk.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        # No post-processor: BOS is the Tokenizer's business. Added tokens in the text still parse as one id.
        # encode_batch, not encode: it releases the GIL (encode holds it, 7 s for 4 MB of text), so the server's
        # event loop keeps turning while a thread tokenizes a long prompt.
        return self.tk.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tk.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        text = self.tk.decode([token_id], skip_special_tokens=False)
        # Metaspace decoders strip the word-start space of a lone token; logprobs should show it.
        if (self.tk.id_to_token(token_id) or "").startswith("▁") and not text.startswith(" "):
            text = " " + text
        return text

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.tk.token_to_id(token)

    def token_bytes(self) -> list[bytes]:
        special = {i for i, t in self.tk.get_added_tokens_decoder().items() if t.special}
        byte_level = "ByteLevel" in repr(json.loads(self.tk.to_str()).get("decoder"))
        to_byte = _byte_level_chars() if byte_level else {}
        out = []
        for i in range(self.vocab_size):
            piece = self.tk.id_to_token(i)
            if piece is None or i in special:
                out.append(b"")
            elif byte_level:
                out.append(bytes(to_byte[c] for c in piece) if all(c in to_byte for c in piece) else piece.encode())
            elif _BYTE_PIECE.fullmatch(piece):  # SentencePiece-style byte fallback, <0xE2>
                out.append(bytes([int(piece[3:5], 16)]))
            else:
                out.append(piece.replace("▁", " ").encode())
        return out

    def special_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.tk.id_to_token(token_id) or "")

    def default_bos_id(self) -> int | None:
        return None

    def default_eos_id(self) -> int | None:
        return None

    def adds_bos_by_default(self, bos_id: int | None) -> bool:
        # Without a config flag, trust the tokenizer.json post-processor (Llama 3's adds <|begin_of_text|>).
        return bos_id is not None and self.tk.encode("a", add_special_tokens=True).ids[:1] == [bos_id]


class _SentencePieceBackend:
    """A SentencePiece model plus the tokens it won't parse out of text by itself (control, unknown, added)."""

    def __init__(self, sp: sentencepiece.SentencePieceProcessor, added: dict[str, int], special_ids: set[int]):
        self.sp = sp
        self._added = added                      # text -> id, matched whole in the input
        self._added_text = {i: t for t, i in added.items()}
        self._special_ids = special_ids          # dropped by decode(skip_special_tokens=True)
        self._piece_count = sp.get_piece_size()
        self.vocab_size = max([self._piece_count, *(i + 1 for i in added.values())])
        alternatives = sorted(added, key=len, reverse=True)  # longest first, so "<|a|>b" beats "<|a|>"
        self._split = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")") if added else None

    def encode(self, text: str) -> list[int]:
        if self._split is None:
            return self.sp.encode(text)
        ids: list[int] = []
        # re.split with a group alternates plain text and matched tokens. Each plain segment gets
        # SentencePiece's space prefix, as llama.cpp does after a special token.
        for i, part in enumerate(self._split.split(text)):
            if i % 2:
                ids.append(self._added[part])
            elif part:
                ids.extend(self.sp.encode(part))
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        out: list[str] = []  # non-empty pieces of text only
        run: list[int] = []  # ordinary pieces, decoded together so bytes join into characters
        for token_id in ids:
            if token_id in self._added_text:
                text = self._decode_run(run, after_text=bool(out))
                if text:
                    out.append(text)
                run = []
                if not (skip_special_tokens and token_id in self._special_ids):
                    out.append(self._added_text[token_id])
            elif 0 <= token_id < self._piece_count:
                run.append(token_id)
            # Other ids (padding rows of an embedding past the vocabulary) decode to nothing, as in `tokenizers`.
        out.append(self._decode_run(run, after_text=bool(out)))
        return "".join(out)

    def _decode_run(self, run: list[int], after_text: bool) -> str:
        if not run:
            return ""
        text = self.sp.decode(run)
        # SentencePiece drops the word-start space at the start of every decode call,
        # but only the start of the whole text should lose it.
        if after_text and self.sp.id_to_piece(run[0]).startswith("▁") and not text.startswith(" "):
            text = " " + text
        return text

    def token_text(self, token_id: int) -> str:
        if token_id in self._added_text:
            return self._added_text[token_id]
        if not 0 <= token_id < self._piece_count:
            return ""
        piece = self.sp.id_to_piece(token_id)
        if self.sp.is_byte(token_id):  # "<0xE2>": one byte of a character
            return bytes([int(piece[3:5], 16)]).decode("utf-8", errors="replace")
        return piece.replace("▁", " ")

    def token_bytes(self) -> list[bytes]:
        out = []
        for i in range(self.vocab_size):
            if i in self._added_text:
                out.append(b"" if i in self._special_ids else self._added_text[i].encode())
            elif i >= self._piece_count or self.sp.is_control(i) or self.sp.is_unknown(i):
                out.append(b"")
            elif self.sp.is_byte(i):
                out.append(bytes([int(self.sp.id_to_piece(i)[3:5], 16)]))
            else:
                out.append(self.sp.id_to_piece(i).replace("▁", " ").encode())
        return out

    def token_to_id(self, token: str | None) -> int | None:
        if token is None:
            return None
        if token in self._added:
            return self._added[token]
        token_id = self.sp.piece_to_id(token)
        # unknown pieces map to <unk>, or to -1 where the vocabulary has none (Gemma's marks <unk> a control piece)
        return token_id if 0 <= token_id < self._piece_count and self.sp.id_to_piece(token_id) == token else None

    def special_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self._added_text.get(token_id) or self.sp.id_to_piece(token_id)

    def default_bos_id(self) -> int | None:
        return self.sp.bos_id() if self.sp.bos_id() >= 0 else None

    def default_eos_id(self) -> int | None:
        return self.sp.eos_id() if self.sp.eos_id() >= 0 else None

    def adds_bos_by_default(self, bos_id: int | None) -> bool:
        return bos_id is not None  # HF's LlamaTokenizer default


_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


@functools.cache
def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte in a vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}


# ---- building backends ----

def _byte_level_bpe(tokens: list[str], types: list[int], merges: list[str], pre: str) -> _TokenizersBackend:
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    try:
        tk = tokenizers.Tokenizer(models.BPE(vocab, pairs, fuse_unk=False, ignore_merges=pre in _LLAMA3_PRES))
    except Exception as e:
        raise TokenizerError(f"bad GGUF BPE vocabulary: {e}") from e
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE_SPLITS.get(pre, [_GPT2_SPLIT])]
    tk.pre_tokenizer = pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                   use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    # llama.cpp matches control and user-defined tokens whole in the text; only control ones are
    # "special" (dropped when decoding with skip_special_tokens).
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, kind in zip(tokens, types) if kind == _CONTROL])
    tk.add_tokens([AddedToken(t, special=False, normalized=False)
                   for t, kind in zip(tokens, types) if kind == _USER_DEFINED])
    return _TokenizersBackend(tk)


def _sentencepiece_from_vocab(tokens: list[str], scores: list[float], types: list[int],
                              add_space_prefix: bool) -> _SentencePieceBackend:
    # Built with sentencepiece itself, as a BPE model: llama.cpp's SPM tokenizer reimplements exactly that
    # (merge the best-scoring adjacent pair, fall back to <0xXX> bytes).
    # Some files (Gemma) store whitespace-only tokens as real spaces; SentencePiece looks them up as "▁".
    tokens = ["▁" * len(t) if t and not t.strip(" ") else t for t in tokens]
    byte_fallback = sum(kind == _BYTE for kind in types) == 256
    proto = _sentencepiece_model_proto(tokens, scores, types, add_space_prefix, byte_fallback)
    sp = sentencepiece.SentencePieceProcessor()
    try:
        sp.load_from_serialized_proto(proto)
    except Exception as e:
        raise TokenizerError(f"bad GGUF SentencePiece vocabulary: {e}") from e
    return _sentencepiece_backend(sp, {})


def _sentencepiece_from_file(model_file: Path, added_tokens_decoder: dict[str, dict]) -> _SentencePieceBackend:
    sp = sentencepiece.SentencePieceProcessor()
    try:
        sp.load(str(model_file))
    except Exception as e:
        raise TokenizerError(f"can't load {model_file}: {e}") from e
    return _sentencepiece_backend(sp, added_tokens_decoder)


def _sentencepiece_backend(sp: sentencepiece.SentencePieceProcessor,
                           added_tokens_decoder: dict[str, dict]) -> _SentencePieceBackend:
    added: dict[str, int] = {}
    special: set[int] = set()
    for i in range(sp.get_piece_size()):
        if sp.is_control(i) or sp.is_unknown(i):
            added[sp.id_to_piece(i)] = i
            special.add(i)
    for token_id, token in added_tokens_decoder.items():
        added[token["content"]] = int(token_id)
        if token.get("special", False):
            special.add(int(token_id))
    added.pop("", None)  # an empty control piece can't be written in text
    return _SentencePieceBackend(sp, added, special)


def _sentencepiece_model_proto(tokens: list[str], scores: list[float], types: list[int],
                               add_dummy_prefix: bool, byte_fallback: bool) -> bytes:
    """Serialize a sentencepiece ModelProto (sentencepiece_model.proto) by hand.

    sentencepiece ships its schema only as protobuf-generated code, and protobuf isn't a dependency;
    the handful of fields needed here are easy to write in the wire format.
    """
    def varint(n: int) -> bytes:
        out = bytearray()
        while True:
            out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
            n >>= 7
            if not n:
                return bytes(out)

    def field(number: int, value: int | float | bytes) -> bytes:
        if isinstance(value, bytes):  # wire type 2: length-delimited
            return varint(number << 3 | 2) + varint(len(value)) + value
        if isinstance(value, float):  # wire type 5: 32-bit
            return varint(number << 3 | 5) + struct.pack("<f", value)
        return varint(number << 3) + varint(value)  # wire type 0: varint

    pieces = b"".join(
        field(1, field(1, token.encode()) + field(2, float(score)) + field(3, kind if 1 <= kind <= 6 else _NORMAL))
        for token, score, kind in zip(tokens, scores, types))
    trainer_spec = field(3, 2) + field(35, int(byte_fallback))  # model_type = BPE
    # identity normalizer, keep whitespace runs as they are, spaces become "▁"
    normalizer_spec = field(1, b"identity") + field(3, int(add_dummy_prefix)) + field(4, 0) + field(5, 1)
    return pieces + field(2, trainer_spec) + field(3, normalizer_spec)


# ---- helpers ----

def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TokenizerError(f"can't read {path}: {e}") from e


def _token_content(token: str | dict | None) -> str | None:
    # tokenizer_config.json writes special tokens either as strings or as AddedToken dicts.
    return token.get("content") if isinstance(token, dict) else token


def _hf_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    if (path / "chat_template.jinja").is_file():  # newer transformers save it on its own
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def _flatten_message(message: Any) -> dict:
    if not isinstance(message, dict):
        raise TemplateError("each message must be an object with 'role' and 'content'")
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise TemplateError(f"unsupported message content part {kind!r} (only 'text' parts are supported)")
        texts.append(str(part.get("text", "")))
    return {**message, "content": "\n".join(texts)}


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, separators: tuple | None = None,
            sort_keys: bool = False) -> str:
    # HF's override: jinja's own tojson escapes HTML and non-ASCII, which changes the prompt.
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    # Same settings as transformers, so templates render byte-for-byte like apply_chat_template.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
