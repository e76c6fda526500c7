"""KVPool: one device's paged K/V tensors, in FlashInfer's NHD layout, the KVManager that hands out their pages,
and, for FP8 pools, the per-layer K and V scales."""

from __future__ import annotations

from typing import Sequence

import torch

from nodeserve.device import host_memory
from nodeserve.kv.manager import KVManager, KVObservers
from nodeserve.kv.window import WindowKV
from nodeserve.model.config import ModelConfig


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def kv_cache_dtype(setting: str, model_dtype: torch.dtype) -> torch.dtype:
    """kv.dtype -> the pool's dtype: "auto" keeps the model's, "float16" halves float32's bytes per token (CPU),
    "fp8_e4m3" halves bf16's."""
    return {"fp8_e4m3": torch.float8_e4m3fn, "float16": torch.float16}.get(setting, model_dtype)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, huge_pages: bool) -> torch.Tensor:
    """A pool's zero-filled K/V; on a CPU, with huge_pages, on huge pages (decode attention streams through it)."""
    if device.type == "cpu" and huge_pages:
        return host_memory.zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def kv_pages_for_device(free_bytes: int, headroom_fraction: float, bytes_per_page: int) -> int:
    """Pages that fit in a GPU's free memory once `headroom_fraction` of it is left for activations,
    workspaces and graphs (kv.memory_gib = 0). At least one page, so a nearly full GPU fails loudly later."""
    usable = int(free_bytes * (1.0 - headroom_fraction))
    return max(1, usable // bytes_per_page)


class KVShard:
    """One rank's K/V: its KV heads of every page. layers[i] is [num_pages, 2, page_size, len(heads), head_dim], K at
    [:, 0] and V at [:, 1]; `heads` are the global KV heads it holds (model/tp_layout.py). What an attention
    backend reads and writes. The layers in `window_layers` (a pool with window pages, kv/window.py) hold
    [num_window_pages, ...] instead, indexed by window page ids."""

    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device,
                 heads: range, window_layers: frozenset[int] = frozenset(), num_window_pages: int = 0,
                 huge_pages: bool = True):
        self.num_pages, self.page_size, self.dtype, self.device, self.heads = num_pages, page_size, dtype, device, heads
        self.window_layers = window_layers
        shape = (2, page_size, len(heads), cfg.head_dim)
        num_full = cfg.num_layers - len(window_layers)
        # One allocation for all (full) layers; zero-filled so padding reads see finite values.
        self.data = _zeros((num_full, num_pages, *shape), dtype, device, huge_pages)
        self.window_data = _zeros((len(window_layers), num_window_pages, *shape), dtype, device, huge_pages)
        full, windowed = iter(self.data.unbind(0)), iter(self.window_data.unbind(0))
        self.layers = [next(windowed) if i in window_layers else next(full) for i in range(cfg.num_layers)]
        self.k_scales = [1.0] * cfg.num_layers
        self.v_scales = [1.0] * cfg.num_layers

    @property
    def is_fp8(self) -> bool:
        return self.dtype == torch.float8_e4m3fn

    @property
    def bytes_per_page_per_layer(self) -> int:
        return self.layers[0][0].numel() * self.data.element_size()


class KVPool:
    """A device's paged KV cache: one KVManager (one page-id space) over one KVShard per rank. A single device's
    pool has one shard holding every head, and reads as that shard (data, layers); a tensor-parallel group's has one
    per rank, each holding its share of every page's heads, and is read through `shards`, or whole pages through
    read_layer / write_layer.

    FP8 pools store K of layer i as clamp(k / k_scales[i], +-448) in e4m3 and read it back as stored * k_scales[i]
    (V likewise with v_scales[i]). The scales are 1.0 until calibrated (runtime/kv_calibration.py); wide pools
    ignore them. Pools that hand KV to each other must hold the same scales: the transfer copies bytes.
    """

    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device,
                 prefix_cache: bool = False, observers: KVObservers | None = None,
                 shards: Sequence[tuple[torch.device, range]] | None = None, num_window_pages: int = 0,
                 max_chunk: int = 0, huge_pages: bool = True):
        """shards: (device, global KV heads) per rank of a tensor-parallel group; None: one shard on `device`.
        num_window_pages > 0 (a model with windowed layers): those layers keep their window only, in pages of their
        own (kv/window.py), for requests whose prompt chunks here are at most max_chunk tokens; 0: every layer keeps
        every page. huge_pages: a CPU shard's K/V on transparent huge pages (devices.huge_pages)."""
        self.num_pages, self.page_size, self.dtype, self.device = num_pages, page_size, dtype, device
        self.num_layers, self.num_kv_heads = cfg.num_layers, cfg.num_kv_heads
        windows = [cfg.window(i) for i in range(cfg.num_layers)] if num_window_pages else [0] * cfg.num_layers
        self.window_layers = frozenset(i for i, w in enumerate(windows) if w)
        self.num_window_pages = num_window_pages if self.window_layers else 0
        self.shards = [KVShard(cfg, num_pages, page_size, dtype, d, heads, self.window_layers, self.num_window_pages,
                               huge_pages)
                       for d, heads in (shards or [(device, range(cfg.num_kv_heads))])]
        self.k_scales = [1.0] * cfg.num_layers
        self.v_scales = [1.0] * cfg.num_layers
        self.manager = KVManager(num_pages, page_size, prefix_cache, observers)
        # the windowed layers' pages, apart; None where every layer keeps every page
        self.window = WindowKV(KVManager(self.num_window_pages, page_size, prefix_cache), max(windows), max_chunk) \
            if self.window_layers else None
        # Recorded on the owner's stream just before it frees pages: a transfer writing into pages it was handed
        # waits on it, so no earlier compute or copy still touches them (None on CPU, where streams are in order).
        self.freed_event = None

    @property
    def heads(self) -> tuple[range, ...]:
        """Global KV heads per shard (core/reshard.py plans copies between two pools from these)."""
        return tuple(s.heads for s in self.shards)

    def _one_shard(self) -> KVShard:
        if len(self.shards) != 1:
            raise TypeError("a tensor-parallel pool keeps one shard per rank: read pool.shards, or whole pages "
                            "with read_layer / write_layer")
        return self.shards[0]

    @property
    def data(self) -> torch.Tensor:
        return self._one_shard().data

    @property
    def layers(self) -> list[torch.Tensor]:
        return self._one_shard().layers

    def read_layer(self, layer: int, pages: torch.Tensor) -> torch.Tensor:
        """Layer `layer` of `pages` with every head: [len(pages), 2, page_size, num_kv_heads, head_dim] on this
        pool's device; each head from the first shard holding it."""
        if len(self.shards) == 1:
            return self.shards[0].layers[layer].index_select(0, pages)
        parts, next_head = [], 0
        for s in self.shards:
            if s.heads.stop > next_head:  # a replicated head is read once
                lo = next_head - s.heads.start
                parts.append(s.layers[layer][:, :, :, lo:].index_select(0, pages.to(s.device)).to(self.device))
                next_head = s.heads.stop
        return torch.cat(parts, dim=3)

    def write_layer(self, layer: int, pages: torch.Tensor, kv: torch.Tensor) -> None:
        """The inverse of read_layer: kv [len(pages), 2, page_size, num_kv_heads, head_dim] into every shard's heads."""
        for s in self.shards:
            part = kv if len(self.shards) == 1 else kv[:, :, :, s.heads.start:s.heads.stop]
            s.layers[layer].index_copy_(0, pages.to(s.device), part.to(s.device, non_blocking=True))

    def use_scales(self, k_scales: list[float], v_scales: list[float]) -> None:
        """FP8 KV: per-layer scales measured on another pool (every pool must read the raw bytes alike)."""
        self.k_scales, self.v_scales = list(k_scales), list(v_scales)
        for s in self.shards:
            s.k_scales, s.v_scales = self.k_scales, self.v_scales

    @property
    def is_fp8(self) -> bool:
        return self.dtype == torch.float8_e4m3fn

    @staticmethod
    def bytes_per_page(cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
        """Bytes of one page across every layer, K and V (all heads: a group's ranks split them)."""
        return cfg.kv_bytes_per_token * page_size * torch.tensor([], dtype=dtype).element_size()

    @staticmethod
    def num_pages_for_bytes(cfg: ModelConfig, num_bytes: int, page_size: int, dtype: torch.dtype) -> int:
        return max(1, num_bytes // KVPool.bytes_per_page(cfg, page_size, dtype))

    @property
    def bytes_per_page_per_layer(self) -> int:
        """One page of one layer, every head (replicated heads once)."""
        return self.page_size * 2 * self.num_kv_heads * self.shards[0].data.shape[-1] * self.shards[0].data.element_size()
