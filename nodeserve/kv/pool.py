"""KVPool: one device's paged K/V tensors, in FlashInfer's NHD layout, plus their allocator."""

from __future__ import annotations

import torch

from nodeserve.kv.allocator import PageAllocator
from nodeserve.model.config import ModelConfig


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class KVPool:
    """layers[i] is [num_pages, 2, page_size, num_kv_heads, head_dim]: K at [:, 0], V at [:, 1]."""

    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device):
        self.num_pages, self.page_size, self.dtype, self.device = num_pages, page_size, dtype, device
        # One allocation for all layers; zero-filled so padding reads see finite values.
        self.data = torch.zeros(cfg.num_layers, num_pages, 2, page_size, cfg.num_kv_heads, cfg.head_dim,
                                dtype=dtype, device=device)
        self.layers = list(self.data.unbind(0))
        self.allocator = PageAllocator(num_pages)

    @staticmethod
    def num_pages_for_bytes(cfg: ModelConfig, num_bytes: int, page_size: int, dtype: torch.dtype) -> int:
        page_bytes = cfg.kv_bytes_per_token * page_size * torch.tensor([], dtype=dtype).element_size()
        return max(1, num_bytes // page_bytes)

    @property
    def bytes_per_page_per_layer(self) -> int:
        return self.layers[0][0].numel() * self.data.element_size()
