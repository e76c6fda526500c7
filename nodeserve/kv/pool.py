"""KVPool: one device's paged K/V tensors, in FlashInfer's NHD layout, the KVManager that hands out their pages,
and, for FP8 pools, the per-layer K and V scales."""

from __future__ import annotations

import torch

from nodeserve.kv.manager import KVManager, KVObservers
from nodeserve.model.config import ModelConfig


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def kv_cache_dtype(setting: str, model_dtype: torch.dtype) -> torch.dtype:
    """kv.dtype -> the pool's dtype: "auto" keeps the model's, "float16" halves float32's bytes per token (CPU),
    "fp8_e4m3" halves bf16's."""
    return {"fp8_e4m3": torch.float8_e4m3fn, "float16": torch.float16}.get(setting, model_dtype)


def kv_pages_for_device(free_bytes: int, headroom_fraction: float, bytes_per_page: int) -> int:
    """Pages that fit in a GPU's free memory once `headroom_fraction` of it is left for activations,
    workspaces and graphs (kv.memory_gib = 0). At least one page, so a nearly full GPU fails loudly later."""
    usable = int(free_bytes * (1.0 - headroom_fraction))
    return max(1, usable // bytes_per_page)


class KVPool:
    """layers[i] is [num_pages, 2, page_size, num_kv_heads, head_dim]: K at [:, 0], V at [:, 1].

    FP8 pools store K of layer i as clamp(k / k_scales[i], +-448) in e4m3 and read it back as stored * k_scales[i]
    (V likewise with v_scales[i]). The scales are 1.0 until calibrated (runtime/kv_calibration.py); wide pools
    ignore them. Pools that hand KV to each other must hold the same scales: the transfer copies bytes.
    """

    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device,
                 prefix_cache: bool = False, observers: KVObservers | None = None):
        self.num_pages, self.page_size, self.dtype, self.device = num_pages, page_size, dtype, device
        # One allocation for all layers; zero-filled so padding reads see finite values.
        self.data = torch.zeros(cfg.num_layers, num_pages, 2, page_size, cfg.num_kv_heads, cfg.head_dim,
                                dtype=dtype, device=device)
        self.layers = list(self.data.unbind(0))
        self.k_scales = [1.0] * cfg.num_layers
        self.v_scales = [1.0] * cfg.num_layers
        self.manager = KVManager(num_pages, page_size, prefix_cache, observers)
        # Recorded on the owner's stream just before it frees pages: a transfer writing into pages it was handed
        # waits on it, so no earlier compute or copy still touches them (None on CPU, where streams are in order).
        self.freed_event = None

    def use_scales(self, k_scales: list[float], v_scales: list[float]) -> None:
        """FP8 KV: per-layer scales measured on another pool (every pool must read the raw bytes alike)."""
        self.k_scales, self.v_scales = list(k_scales), list(v_scales)

    @property
    def is_fp8(self) -> bool:
        return self.dtype == torch.float8_e4m3fn

    @staticmethod
    def bytes_per_page(cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
        """Bytes of one page across every layer, K and V."""
        return cfg.kv_bytes_per_token * page_size * torch.tensor([], dtype=dtype).element_size()

    @staticmethod
    def num_pages_for_bytes(cfg: ModelConfig, num_bytes: int, page_size: int, dtype: torch.dtype) -> int:
        return max(1, num_bytes // KVPool.bytes_per_page(cfg, page_size, dtype))

    @property
    def bytes_per_page_per_layer(self) -> int:
        return self.layers[0][0].numel() * self.data.element_size()
