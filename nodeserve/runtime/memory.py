"""Whether a model replica and its KV pool fit in a device's free memory, checked before anything is copied."""

from __future__ import annotations

import itertools

import torch

from nodeserve.config import ConfigError


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))


def check_fits(device_name: str, free_bytes: int, weight_bytes: int, kv_bytes: int) -> None:
    """A clear error, before any copy, when a GPU cannot hold what it is given: a CUDA out-of-memory error half-way
    through copying the weights names neither the model nor the fix."""
    gib = 2**30
    if weight_bytes > free_bytes:
        raise ConfigError(f"the model's weights ({weight_bytes / gib:.1f} GiB) do not fit in {device_name}'s free "
                          f"memory ({free_bytes / gib:.1f} GiB): every GPU holds a whole replica (there is no "
                          "tensor parallelism); use a smaller model or dtype, or free the GPU")
    if weight_bytes + kv_bytes > free_bytes:
        raise ConfigError(f"'kv.memory_gib' = {kv_bytes / gib:g} does not fit in {device_name}: "
                          f"{free_bytes / gib:.1f} GiB free, {weight_bytes / gib:.1f} GiB of it for the weights; "
                          f"lower it, or set 0 to use what is free less 'kv.memory_headroom'")
