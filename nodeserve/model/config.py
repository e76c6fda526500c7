"""ModelConfig: the architecture numbers every loader fills in and the model reads; an HF config.json read into one
(no torch: `nodeserve plan --model-config` reads a model's shape without its weights)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from nodeserve.model import registry


class LoadError(Exception):
    """A checkpoint could not be loaded. The message is one line that names the problem."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str            # a key of model/registry.ARCHITECTURES: "llama", "qwen2", "qwen3", "gemma3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: dict | None = None  # HF rope_scaling dict, e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    # What families add to the Llama layout (model/registry.py says which family sets which):
    qk_norm: bool = False        # RMSNorm over each head's q and k before RoPE (Qwen3, Gemma 3)
    sandwich_norm: bool = False  # a norm after attention and after the MLP too, before each residual add (Gemma)
    hidden_act: str = "silu"     # the gated MLP's activation: "silu" or "gelu_tanh" (GeGLU, Gemma)
    embed_scale: float = 1.0     # embeddings are multiplied by it (Gemma: sqrt(hidden_size))
    query_scale: float | None = None  # attention's softmax scale; None: head_dim ** -0.5 (Gemma: its own scalar)
    # Per layer, how many most recent positions (the query's own included) it attends to; 0: every one. Empty:
    # every layer is global. Gemma 3: 512 or 1,024 on five layers of six.
    layer_windows: tuple[int, ...] = ()
    rope_local_theta: float | None = None  # RoPE base of the windowed layers, when it is not rope_theta's

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise LoadError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise LoadError(f"{len(self.layer_windows)} layer windows for {self.num_layers} layers")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise LoadError(f"unsupported MLP activation '{self.hidden_act}' (supported: silu, gelu_tanh)")

    def window(self, layer: int) -> int:
        """How many most recent positions layer `layer` attends to (the query's own included); 0: all of them."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def softmax_scale(self) -> float:
        return self.query_scale if self.query_scale is not None else self.head_dim ** -0.5

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token across all layers, per byte of element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def config_from_hf(path: str) -> ModelConfig:
    """An HF checkpoint directory's config.json, or a config.json file itself."""
    config_path = path if os.path.isfile(path) else os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise LoadError(f"{path}: no config.json in this checkpoint directory")
    try:
        with open(config_path) as f:
            c = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise LoadError(f"{config_path}: cannot read it ({e})") from None
    if not isinstance(c, dict):
        raise LoadError(f"{config_path}: not an HF config.json (a JSON object)")
    try:
        arch = registry.by_hf_classes(c.get("architectures") or [c.get("model_type")], path)
    except ValueError as e:
        raise LoadError(str(e)) from None
    try:
        num_heads = c["num_attention_heads"]
        fields = dict(
            architecture=arch.name,
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=c.get("num_key_value_heads") or num_heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // num_heads,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(c),
            max_position_embeddings=c.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            attention_bias=bool(c.get("attention_bias", False)),
            rope_scaling=c.get("rope_scaling") or _rope_parameters_scaling(c),
        )
        fields.update(arch.hf_fields(c))
        return ModelConfig(**fields)
    except KeyError as e:
        raise LoadError(f"{config_path}: no {e.args[0]!r}") from None


def _rope_theta(c: dict) -> float:
    params = c.get("rope_parameters") or {}
    params = params.get("full_attention", params)  # Gemma 3: one set per layer type
    return float(c.get("rope_theta") or params.get("rope_theta", 10000.0))


def _rope_parameters_scaling(c: dict) -> dict | None:
    # transformers >= 5 writes rope settings under "rope_parameters" instead of "rope_scaling".
    params = c.get("rope_parameters") or {}
    params = params.get("full_attention", params)
    if params.get("rope_type", "default") == "default":
        return None
    return params
