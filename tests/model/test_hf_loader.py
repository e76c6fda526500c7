"""HF checkpoint directories: tiny random Llama / Qwen2 models saved with transformers, loaded by nodeserve,
run through ModelRunner over a paged pool, and compared with transformers' logits in float32."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece")

from nodeserve.attention.torch_ref import TorchAttention  # noqa: E402
from nodeserve.runtime.model_runner import ModelRunner, SeqChunk  # noqa: E402
from nodeserve.kv.pool import KVPool, pages_for  # noqa: E402
from nodeserve.model.loader import load_model  # noqa: E402

VOCAB = 300
ATOL = 1e-4
PAGE_SIZE = 4
NUM_DECODE = 5
PROMPT = "kalo mine rusa, the quick brown fox jumps over the lazy dog. vize quan elor 2024!"
SECOND_PROMPT = "ipus thch stor kalomi nezeru"

COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=128, max_position_embeddings=256, rms_norm_eps=1e-6,
              bos_token_id=1, eos_token_id=2)

CASES = {
    "llama": lambda: transformers.LlamaConfig(vocab_size=VOCAB, **COMMON),
    "llama3_rope": lambda: transformers.LlamaConfig(
        vocab_size=VOCAB, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16},
        **COMMON),
    "llama_sharded": lambda: transformers.LlamaConfig(vocab_size=VOCAB, **COMMON),
    # Qwen2 has q/k/v biases; small Qwen2 models also tie the embeddings, and pad the vocabulary past the tokenizer.
    "qwen2": lambda: transformers.Qwen2Config(vocab_size=VOCAB + 20, tie_word_embeddings=True, **COMMON),
    "qwen2_untied": lambda: transformers.Qwen2Config(vocab_size=VOCAB, tie_word_embeddings=False, **COMMON),
}


pytestmark = pytest.mark.usefixtures("one_thread")


def _corpus() -> list[str]:
    rng = random.Random(0)
    syl = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ze", "qu", "an", "el", "or", "ip", "us", "th", "ch", "st"]
    words = ["".join(rng.choice(syl) for _ in range(rng.randint(1, 4))) for _ in range(400)]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 15))) + rng.choice(".!?,")
             for _ in range(3000)]
    return lines + ["The quick brown fox jumps over the lazy dog 0123456789 ABCDEFGHIJKLMNOPQRSTUVWXYZ"] * 3


@pytest.fixture(scope="module")
def sp_model() -> bytes:
    import io

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_corpus()), model_writer=buf, vocab_size=VOCAB,
                                   model_type="bpe", character_coverage=1.0, minloglevel=2)
    return buf.getvalue()


def _write_tokenizer(path: Path, sp_model: bytes) -> None:
    (path / "tokenizer.model").write_bytes(sp_model)
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False,
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
    }))


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory, sp_model):
    """(case name, checkpoint dir, the transformers model in float32)."""
    name = request.param
    torch.manual_seed(1234)
    config = CASES[name]()
    cls = transformers.Qwen2ForCausalLM if name.startswith("qwen2") else transformers.LlamaForCausalLM
    hf = cls(config).float().eval()
    if name.startswith("qwen2"):  # random init leaves biases at zero; make them matter
        with torch.no_grad():
            for layer in hf.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    path = tmp_path_factory.mktemp(name)
    kwargs = {"max_shard_size": "60KB"} if name == "llama_sharded" else {}
    hf.save_pretrained(path, safe_serialization=True, **kwargs)
    _write_tokenizer(path, sp_model)
    if name == "llama_sharded":
        assert (path / "model.safetensors.index.json").is_file()
        assert len(list(path.glob("*.safetensors"))) > 1
    return name, path, hf


@pytest.fixture(scope="module")
def refs(checkpoint, loaded):
    """prompt text -> (prompt ids, prompt + transformers' greedy continuation, its logits [L, V])."""
    _, _, hf = checkpoint
    out = {}
    for text in (PROMPT, SECOND_PROMPT):
        prompt = loaded.tokenizer.encode(text)
        full, logits = _hf_reference(hf, prompt, NUM_DECODE)
        out[text] = prompt, full, logits
    return out


@pytest.fixture(scope="module")
def loaded(checkpoint):
    _, path, _ = checkpoint
    return load_model(str(path), torch.float32)


def _hf_reference(hf, prompt: list[int], num_new: int) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation by transformers (full forward each step) and the logits [L, V] of prompt + continuation."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num_new):
            logits = hf(torch.tensor([ids])).logits[0]
            ids.append(int(logits[-1].argmax()))
        logits = hf(torch.tensor([ids])).logits[0].float()
    return ids, logits


def _shuffled_table(pool: KVPool, num_tokens: int, rng: random.Random) -> list[int]:
    pages = pool.manager.allocate(pages_for(num_tokens, pool.page_size))
    rng.shuffle(pages)
    return pages


def _new_runner(loaded, num_pages: int = 128) -> ModelRunner:
    pool = KVPool(loaded.config, num_pages, PAGE_SIZE, torch.float32, torch.device("cpu"))
    # Pages are reused in practice: fill the pool with garbage so a read past a sequence's KV would show.
    pool.data.normal_(0, 10)
    return ModelRunner(loaded.model, TorchAttention(pool, loaded.config, loaded.model.dtype))


def test_config_matches(checkpoint, loaded):
    name, path, hf = checkpoint
    cfg, hc = loaded.config, hf.config
    assert cfg.architecture == ("qwen2" if name.startswith("qwen2") else "llama")
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers) == (hc.vocab_size, hc.hidden_size, hc.num_hidden_layers)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.attention_bias == name.startswith("qwen2")
    assert cfg.tie_word_embeddings == bool(hc.tie_word_embeddings)
    if name == "llama3_rope":
        assert cfg.rope_scaling and cfg.rope_scaling["rope_type"] == "llama3"
        assert cfg.rope_theta == 500000.0
    else:
        assert not cfg.rope_scaling
    if cfg.tie_word_embeddings:
        assert loaded.model.lm_head.weight is loaded.model.embed_tokens.weight


def test_tokenizer_matches_sentencepiece(checkpoint, loaded, sp_model):
    sp = spm.SentencePieceProcessor(model_proto=sp_model)
    tok = loaded.tokenizer
    for text in (PROMPT, SECOND_PROMPT, "Hello world", "a  b   c", ""):
        assert tok.encode(text, add_bos=False) == sp.encode(text)
        assert tok.encode(text) == [sp.bos_id()] + sp.encode(text)  # add_bos_token: true
    assert tok.bos_token_id == sp.bos_id() == 1
    assert sp.eos_id() in tok.eos_token_ids
    ids = sp.encode(PROMPT)
    assert tok.decode(ids) == sp.decode(ids) == PROMPT


def test_prefill_in_one_chunk_matches_every_position(loaded, refs):
    prompt, _, ref = refs[PROMPT]
    assert len(prompt) > 3 * PAGE_SIZE
    ref = ref[:len(prompt)]
    runner = _new_runner(loaded)
    table = _shuffled_table(runner.pool, len(prompt), random.Random(0))
    # All positions, not only the last: run the model on the runner's prepared step and project every row.
    ids, positions, meta, rows = runner.prepare([SeqChunk(prompt, 0, table)])
    runner.backend.prepare(meta)
    hidden = loaded.model(ids, positions, runner.backend)
    logits = loaded.model.compute_logits(hidden)
    assert logits.shape == (len(prompt), loaded.config.vocab_size)
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)
    assert rows == [len(prompt) - 1]


@pytest.mark.parametrize("chunk_sizes", [(5, 7, 1, 3), (1, 1, 2, 9), (PAGE_SIZE, PAGE_SIZE, 2 * PAGE_SIZE - 1)])
def test_chunked_prefill_then_decode_matches(loaded, refs, chunk_sizes):
    prompt, full, ref = refs[PROMPT]
    runner = _new_runner(loaded)
    table = _shuffled_table(runner.pool, len(full), random.Random(sum(chunk_sizes)))
    done = 0
    sizes = list(chunk_sizes)
    while done < len(prompt):
        n = min(sizes.pop(0) if sizes else len(prompt), len(prompt) - done)
        logits = runner.run([SeqChunk(prompt[done:done + n], done, table)])
        done += n
        assert logits.shape == (1, loaded.config.vocab_size)
        torch.testing.assert_close(logits[0], ref[done - 1], atol=ATOL, rtol=0)
    assert int(logits[0].argmax()) == full[len(prompt)]
    # Decode: feed transformers' greedy tokens one at a time.
    for pos in range(len(prompt), len(full)):
        logits = runner.run([SeqChunk([full[pos]], pos, table)])
        torch.testing.assert_close(logits[0], ref[pos], atol=ATOL, rtol=0)


def test_decode_steps_match(loaded, refs):
    prompt, full, ref = refs[PROMPT]
    runner = _new_runner(loaded)
    table = _shuffled_table(runner.pool, len(full), random.Random(7))
    logits = runner.run([SeqChunk(prompt, 0, table)])
    torch.testing.assert_close(logits[0], ref[len(prompt) - 1], atol=ATOL, rtol=0)
    assert int(logits[0].argmax()) == full[len(prompt)]
    for pos in range(len(prompt), len(full)):
        logits = runner.run([SeqChunk([full[pos]], pos, table)])
        torch.testing.assert_close(logits[0], ref[pos], atol=ATOL, rtol=0)
        if pos + 1 < len(full):
            assert int(logits[0].argmax()) == full[pos + 1]


def test_mixed_batch_matches(loaded, refs):
    """One step holding a decode of sequence A and a prefill chunk of sequence B, then both decoding together."""
    a, full_a, ref_a = refs[PROMPT]
    b, full_b, ref_b = refs[SECOND_PROMPT]
    runner = _new_runner(loaded)
    rng = random.Random(3)
    ta, tb = _shuffled_table(runner.pool, len(full_a), rng), _shuffled_table(runner.pool, len(full_b), rng)
    runner.run([SeqChunk(a, 0, ta)])
    half = len(b) // 2
    # B's first chunk wants no logits; A decodes in the same step.
    logits = runner.run([SeqChunk(b[:half], 0, tb, want_logits=False), SeqChunk([full_a[len(a)]], len(a), ta)])
    assert logits.shape[0] == 1
    torch.testing.assert_close(logits[0], ref_a[len(a)], atol=ATOL, rtol=0)
    # B's prefill chunk listed before A's decode: rows come back in chunk order.
    logits = runner.run([SeqChunk(b[half:], half, tb), SeqChunk([full_a[len(a) + 1]], len(a) + 1, ta)])
    torch.testing.assert_close(logits[0], ref_b[len(b) - 1], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1], ref_a[len(a) + 1], atol=ATOL, rtol=0)
    pa, pb = len(a) + 2, len(b)
    for _ in range(NUM_DECODE - 2):
        logits = runner.run([SeqChunk([full_b[pb]], pb, tb), SeqChunk([full_a[pa]], pa, ta)])
        torch.testing.assert_close(logits[0], ref_b[pb], atol=ATOL, rtol=0)
        torch.testing.assert_close(logits[1], ref_a[pa], atol=ATOL, rtol=0)
        pa, pb = pa + 1, pb + 1
