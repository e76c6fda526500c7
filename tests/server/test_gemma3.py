"""The second bundled model, Gemma 3 270M Q4_K_M, through the server on the exact path: greedy output equals
transformers' (float32, the same file's weights) for ten prompts, two of them longer than its 512-token sliding
window, colocated and disaggregated, all at once, and streamed; its chat template and end-of-turn token."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from tests.conftest import CHAT_PROMPTS, RAW_PROMPTS
from tests.server.conftest import Server
from tests.server.test_api import _assert_pools_whole

NUM_NEW_TOKENS = 24
MODEL = "gemma-3-270m"


def _long_prompt(seed: int) -> str:
    """A text of ~1,000 tokens that a model can continue (a numbered inventory), the same on every run."""
    items = ["apples", "copper wire", "blue paint", "oak planks", "salt", "lanterns", "wool", "glass jars"]
    lines = [f"{n}. Crate {n * 7 + seed} holds {(n * 13 + seed) % 90 + 10} units of {items[(n + seed) % len(items)]}."
             for n in range(1, 90)]
    return "Warehouse inventory:\n" + "\n".join(lines) + "\nThe crate with the most units is crate"


@pytest.fixture(scope="module")
def gemma():
    from nodeserve.model.loader import load_model

    return load_model(MODEL, torch.float32)


@pytest.fixture(scope="module")
def prompts(gemma) -> list[tuple[str, list[int]]]:
    """(kind, token ids): chat prompts through Gemma's template, raw texts, and two past the window."""
    tok = gemma.tokenizer
    chat = [("chat", tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_bos=False))
            for p in CHAT_PROMPTS + ["Name a colour.", "Count from one to five."]]
    raw = [("raw", tok.encode(p)) for p in RAW_PROMPTS[:2] + [_long_prompt(0), _long_prompt(3)]]
    return chat + raw


@pytest.fixture(scope="module")
def reference(gemma, prompts) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(gemma.path), gguf_file=os.path.basename(gemma.path),
                                              dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # past EOS, as ignore_eos does
    with torch.inference_mode():
        return [hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                            max_new_tokens=NUM_NEW_TOKENS, do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
                for _, ids in prompts]


def test_prompts_reach_past_the_window(gemma, prompts):
    assert gemma.config.architecture == "gemma3" and max(gemma.config.layer_windows) == 512
    assert sum(len(ids) > 512 for _, ids in prompts) == 2


def test_chat_template_and_end_of_turn(gemma):
    tok = gemma.tokenizer
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert tok.encode(text, add_bos=False)[:2] == [tok.bos_token_id, tok.encode("<start_of_turn>", add_bos=False)[0]]
    assert tok.encode("<end_of_turn>", add_bos=False)[0] in tok.eos_token_ids


@pytest.mark.slow
@pytest.mark.parametrize("devices", ['mode = "colocated"\ndevices = ["cpu:0", "cpu:1"]',
                                     'mode = "disaggregated"\nprefill = ["cpu:0"]\ndecode = ["cpu:1"]'],
                         ids=["colocated", "disaggregated"])
def test_server_greedy_equals_transformers(tmp_path, devices, gemma, prompts, reference):
    server = Server(tmp_path, devices, model=MODEL, name="gemma")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        greedy = {"temperature": 0.0, "max_tokens": NUM_NEW_TOKENS, "extra_body": {"ignore_eos": True}}

        def one(i: int) -> str:
            kind, ids = prompts[i]
            if kind == "chat":
                messages = [{"role": "user", "content": (CHAT_PROMPTS + ["Name a colour.",
                                                                          "Count from one to five."])[i]}]
                return client.chat.completions.create(model="gemma", messages=messages,
                                                      **greedy).choices[0].message.content
            return client.completions.create(model="gemma", prompt=ids, **greedy).choices[0].text

        with ThreadPoolExecutor(len(prompts)) as pool:  # all at once: batched, chunked, concurrent
            texts = list(pool.map(one, range(len(prompts))))
        tok = gemma.tokenizer
        assert texts == [tok.decode(ref) for ref in reference]
        stream = client.completions.create(model="gemma", prompt=prompts[-1][1], stream=True, **greedy)
        assert "".join(c.choices[0].text for c in stream) == tok.decode(reference[-1])
        _assert_pools_whole(server)
    finally:
        server.stop()
