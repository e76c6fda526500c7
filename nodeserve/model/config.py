"""ModelConfig: the architecture numbers every loader fills in and the model reads."""

from __future__ import annotations

from dataclasses import dataclass


class LoadError(Exception):
    """A checkpoint could not be loaded. The message is one line that names the problem."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str            # "llama" or "qwen2": the Llama layout, Qwen2 adds q/k/v biases
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

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise LoadError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token across all layers, per byte of element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim
