"""The reference attention backend: paged KV in plain PyTorch. Runs on CPU and CUDA, over pools in the model's
dtype or in FP8 (e4m3) with per-layer scales; the quantizing write here is the one FlashInfer's backend uses too."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nodeserve.attention.base import AttentionMetadata, KVPoolLike, ModelConfigLike, PagedAttention
from nodeserve.kernels import native

log = logging.getLogger(__name__)

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn value


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V ([T, KH, D] each) into the pool at the given flat slots."""
    page_size = kv_layer.shape[2]
    pages, offsets = slot_mapping // page_size, slot_mapping % page_size
    kv_layer[pages, 0, offsets] = k.to(kv_layer.dtype)  # a float16 pool under a float32 model rounds here
    kv_layer[pages, 1, offsets] = v.to(kv_layer.dtype)


def is_fp8(kv_layer: torch.Tensor) -> bool:
    return kv_layer.element_size() == 1 and kv_layer.is_floating_point()


def write_kv_scaled(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                    k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """write_kv, quantizing to the pool's dtype when it is FP8: stored = clamp(x / scale, +-448), read back as
    stored * scale (the k_scale/v_scale FlashInfer's run() takes). Wide pools ignore the scales."""
    if not is_fp8(kv_layer):
        write_kv(kv_layer, k, v, slot_mapping)
        return
    # Clamp first: casting a value beyond e4m3's range gives NaN, not the largest value.
    k8 = (k.float() / k_scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(kv_layer.dtype)
    v8 = (v.float() / v_scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(kv_layer.dtype)
    # Scatter the bytes: index_put has no float8 kernel on every device, uint8 works everywhere.
    write_kv(kv_layer.view(torch.uint8), k8.view(torch.uint8), v8.view(torch.uint8), slot_mapping)


def fp8_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous float8_e4m3fn tensor converted to `dtype` (exactly: every e4m3 value is a bf16, fp16 and fp32
    value). On CPU through a 256-entry table indexed by the byte: torch's CPU conversion is scalar, the lookup
    faster (bench/README.md)."""
    if x.device.type != "cpu":
        return x.to(dtype)
    table = torch.arange(256, dtype=torch.uint8, device=x.device).view(x.dtype).to(dtype)  # [256]
    return table.index_select(0, x.view(torch.uint8).reshape(-1).int()).view(x.shape)


def gather_kv(kv_layer: torch.Tensor, page_table: torch.Tensor, length: int,
              dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one or more sequences: page_table [B, P] -> ([B, length, KH, D], [B, length, KH, D]),
    as stored (FP8 values are not multiplied by their scale), converted to `dtype` when given.

    index_select per K and V writes each straight into a contiguous [B, P * page_size, KH, D] buffer:
    4-8x faster on CPU than advanced indexing of the whole [.., 2, ..] page followed by a transpose copy.
    """
    b, num_pages = page_table.shape
    flat = page_table.reshape(-1)
    shape = (b, num_pages * kv_layer.shape[2], *kv_layer.shape[3:])
    src = kv_layer.view(torch.uint8) if is_fp8(kv_layer) else kv_layer  # index_select lacks float8 on some devices
    k = src[:, 0].index_select(0, flat).view(shape).view(kv_layer.dtype)
    v = src[:, 1].index_select(0, flat).view(shape).view(kv_layer.dtype)
    k, v = _converted(kv_layer, k, v, dtype)
    return k[:, :length], v[:, :length]


def gather_slots(kv_layer: torch.Tensor, slots: torch.Tensor,
                 dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V at the given pool slots (page * page_size + offset), reading nothing else: slots [B, L] ->
    ([B, L, KH, D], [B, L, KH, D]), as gather_kv returns them. For sliding windows, whose rows start mid-page."""
    page_size, flat = kv_layer.shape[2], slots.reshape(-1)
    pages, offsets = flat // page_size, flat % page_size
    shape = (*slots.shape, *kv_layer.shape[3:])
    src = kv_layer.view(torch.uint8) if is_fp8(kv_layer) else kv_layer
    k = src[pages, 0, offsets].view(shape).view(kv_layer.dtype)
    v = src[pages, 1, offsets].view(shape).view(kv_layer.dtype)
    return _converted(kv_layer, k, v, dtype)


def _converted(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    if dtype is not None and dtype != kv_layer.dtype:
        k, v = (fp8_to(k, dtype), fp8_to(v, dtype)) if is_fp8(kv_layer) else (k.to(dtype), v.to(dtype))
    return k, v


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           is_causal: bool, scale: float) -> torch.Tensor:
    """q [B, Lq, H, D], k/v [B, Lk, KH, D] -> [B, Lq, H, D]; grouped-query heads are expanded like HF's repeat_kv."""
    groups = q.shape[2] // k.shape[2]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, L, D]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
    return out.transpose(1, 2)


def attend_after_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """A prefill chunk after a cached prefix, on CPU: q [1, Lq, H, D], k/v [1, Lk, KH, D] (the prefix's Lk - Lq
    keys, then the chunk's) -> [1, Lq, H, D]; query i sees the prefix and the chunk's keys up to its own.

    Two calls of torch's CPU flash kernel (the op behind SDPA, which also returns the log-sum-exp SDPA drops),
    merged by their log-sum-exps: the prefix with no mask (the G query heads of a KV
    head stacked as G x Lq rows, so K/V are not repeated) and the chunk causally. A masked call computes every
    score, the masked-out ones too, and builds the mask: a 1k chunk after 1k cached tokens took 54 -> 38 ms a
    layer on one core (the Xeon)."""
    num_q, num_heads, head_dim = q.shape[1], q.shape[2], q.shape[3]
    num_kv_heads, num_prefix = k.shape[2], k.shape[1] - q.shape[1]
    groups = num_heads // num_kv_heads
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    qh = q.transpose(1, 2).contiguous()                                    # [1, H, Lq, D]
    kh, vh = k.transpose(1, 2), v.transpose(1, 2)                          # [1, KH, Lk, D]
    out_p, lse_p = flash(qh.view(1, num_kv_heads, groups * num_q, head_dim), kh[:, :, :num_prefix],
                         vh[:, :, :num_prefix], 0.0, False, scale=scale)  # [1, KH, G * Lq, D], [1, KH, G * Lq]
    kc, vc = kh[:, :, num_prefix:], vh[:, :, num_prefix:]
    if groups > 1:
        kc, vc = kc.repeat_interleave(groups, dim=1), vc.repeat_interleave(groups, dim=1)
    out_c, lse_c = flash(qh, kc, vc, 0.0, True, scale=scale)              # [1, H, Lq, D], [1, H, Lq]
    out_p, lse_p = out_p.reshape(1, num_heads, num_q, head_dim), lse_p.reshape(1, num_heads, num_q)
    lse = torch.logaddexp(lse_p, lse_c)
    out = out_p * torch.exp(lse_p - lse)[..., None] + out_c * torch.exp(lse_c - lse)[..., None]
    return out.transpose(1, 2)


def attend_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  scale: float) -> torch.Tensor:
    """One query token per sequence: q [B, H, D], k/v [B, L, KH, D] -> [B, H, D].

    The G query heads that share a KV head become G query rows against that head, so K/V are never
    repeated: each row's softmax is the same computation as with repeated KV.
    """
    b, h, d = q.shape
    kh = k.shape[2]
    qg = q.view(b, kh, h // kh, d)                  # [B, KH, G, D]
    out = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale)
    return out.reshape(b, h, d)


def length_groups(seq_lens: list[int], max_waste: float = 2.0, min_len: int = 256) -> list[list[int]]:
    """Splits decode rows into groups of similar length, so that padding to a group's longest row costs at
    most `max_waste` times the work (short rows below `min_len` all go together: they are cheap)."""
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__)
    groups: list[list[int]] = []
    for i in order:
        if groups and seq_lens[i] <= max(max_waste * seq_lens[groups[-1][0]], min_len):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@dataclass
class _DecodeGroup:
    idx: torch.Tensor | slice  # the group's rows among the decodes
    page_table: torch.Tensor  # [n, pages covering max_len]
    max_len: int
    mask: torch.Tensor         # [n, 1, 1, max_len]: key positions each row may see
    # A windowed layer's group: [n, max_len] the slots of each row's window (gather_slots), padded with its last
    # one; None: the rows read their pages from the first (page_table).
    slots: torch.Tensor | None = None


class TorchAttention(PagedAttention):
    """On CPU with a float32 model and a float32 or float16 pool, decodes read K/V where they lie in the pages (the
    native kernel: no gather, no padding). Elsewhere decodes are batched in padded SDPA calls over groups of
    similar length, whose rows and masks depend only on the step: prepare() builds them once for every layer. Each
    prefill chunk runs alone, so no one pads to the longest prompt.

    FP8 pools: K/V are gathered as stored and converted to q's dtype (exact: every e4m3 value is a bf16, fp16
    and fp32 value); k_scale is folded into the softmax scale and v_scale applied to the output, which is what
    FlashInfer's run(k_scale=, v_scale=) computes, and spares a pass over the gathered K/V.

    Windowed layers (cfg.window(layer)): the native kernels start at the window's first page; elsewhere decodes
    gather only each row's window and prefill chunks the keys from their first query's window on, with the
    window in the mask. A window no row reaches takes the unwindowed path.
    """

    def __init__(self, pool: KVPoolLike, cfg: ModelConfigLike, dtype: torch.dtype, prompt_attention: str = "float32"):
        """dtype: the model's activations' (q's). prompt_attention (model.prompt_attention): "bfloat16" or "auto",
        the prefill kernel's products in bf16 where the CPU has AVX512-BF16 (only "bfloat16" warns where not);
        "float32" in float32."""
        super().__init__(pool)
        self.scale = cfg.softmax_scale
        self.windows = [cfg.window(i) for i in range(len(pool.layers))]
        kernels = native.load() if pool.device.type == "cpu" and dtype == torch.float32 else None
        # None: no compiler, or not a pool the kernels read (float32, or float16 where F16C is built in)
        self._kernels = kernels if kernels is not None and pool.dtype in kernels.kv_dtypes else None
        # prefill chunks by csrc/prefill_attn.c where built (AVX-512, or AVX2: prefill_attn_avx2.c, which
        # NODESERVE_KERNELS=avx2 picks on an AVX-512 CPU too)
        self._prefill_avx2 = native.avx2_only()
        self._prefill_kernel = self._kernels is not None and (
            self._kernels.prefill_avx2 if self._prefill_avx2 else self._kernels.prefill)
        self._prefill_bf16 = (prompt_attention != "float32" and self._prefill_kernel and not self._prefill_avx2
                              and self._kernels.prefill_bf16)
        if prompt_attention == "bfloat16" and not self._prefill_bf16 and pool.device.type == "cpu":
            log.warning("model.prompt_attention = \"bfloat16\" needs the AVX-512 prefill kernel on a CPU with "
                        "AVX512-BF16 and a float32 model; prompt attention stays float32 here")
        self._groups: dict[int, list[_DecodeGroup]] = {}  # by window

    @property
    def prompt_kernel(self) -> str:
        """How prompt chunks attend here, for the start-up log."""
        if not self._prefill_kernel:
            return "torch"
        isa = "avx2" if self._prefill_avx2 else self._kernels.prefill_isa
        return f"native {isa}, bf16 products" if self._prefill_bf16 else f"native {isa}, float32"

    def prepare(self, meta: AttentionMetadata) -> None:
        super().prepare(meta)
        # windowed layers read their own pages where the pool keeps them apart (kv/window.py)
        self._groups = {w: self._decode_groups(self.window_meta if w else meta, w)  # type: ignore[arg-type]
                        for w in set(self.windows)} if self._kernels is None else {}

    def _decode_groups(self, meta: AttentionMetadata, window: int) -> list[_DecodeGroup]:
        nd, device = meta.num_decodes, self.pool.device
        if window and max(meta.seq_lens_host[:nd], default=0) > window:
            return self._window_groups(meta, window)
        groups = length_groups(meta.seq_lens_host[:nd]) if nd else []
        planned = []
        for rows in groups:
            max_len = max(meta.seq_lens_host[i] for i in rows)
            idx = torch.tensor(rows, device=device) if len(groups) > 1 else slice(0, nd)
            positions = torch.arange(max_len, device=device)
            mask = (positions[None, :] < meta.seq_lens[idx, None])[:, None, None, :]
            table = meta.page_tables[idx, :-(-max_len // meta.page_size)]
            planned.append(_DecodeGroup(idx, table, max_len, mask))
        return planned

    def _window_groups(self, meta: AttentionMetadata, window: int) -> list[_DecodeGroup]:
        """Decode groups of a layer with a window some row outgrows: each row gathers its last `window` slots only,
        so nothing before them is read (their pages may be freed)."""
        nd, device, page_size = meta.num_decodes, self.pool.device, meta.page_size
        lens = [min(n, window) for n in meta.seq_lens_host[:nd]]
        groups = length_groups(lens)
        planned = []
        for rows in groups:
            max_len = max(lens[i] for i in rows)
            idx = torch.tensor(rows, device=device) if len(groups) > 1 else slice(0, nd)
            seq_lens = meta.seq_lens[idx, None]                                          # [n, 1]
            pos = (seq_lens - window).clamp(min=0) + torch.arange(max_len, device=device)  # [n, max_len]
            mask = (pos < seq_lens)[:, None, None, :]
            pos = torch.minimum(pos, seq_lens - 1)  # padding re-reads the row's last key, which the mask drops
            slots = meta.page_tables[idx].gather(1, pos // page_size) * page_size + pos % page_size
            planned.append(_DecodeGroup(idx, meta.page_tables[idx], max_len, mask, slots))
        return planned

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta, kv_layer = self.step_for(layer_id), self.pool.layers[layer_id]
        k_scale, v_scale = self.scales(layer_id)
        kernels = self._kernels
        if kernels is not None:
            kernels.write_kv(kv_layer, k, v, meta.slot_mapping)
        else:
            write_kv_scaled(kv_layer, k, v, meta.slot_mapping, k_scale, v_scale)
        dtype = q.dtype if kv_layer.dtype != q.dtype else None  # FP8, or a float16 pool under a float32 model
        scale, window = self.scale * k_scale, self.windows[layer_id]
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd and kernels is not None:
            out[:nd] = kernels.paged_decode_attention(
                q[:nd].contiguous(), kv_layer, meta.page_tables[:nd], meta.seq_lens[:nd], scale, window)
        elif nd:
            for g in self._groups[window]:
                if g.slots is None:
                    kd, vd = gather_kv(kv_layer, g.page_table, g.max_len, dtype)  # [n, L, KH, D]
                else:
                    kd, vd = gather_slots(kv_layer, g.slots, dtype)
                out[g.idx] = attend_decode(q[g.idx], kd, vd, g.mask, scale)
        start = nd
        for b in range(nd, meta.num_seqs):
            q_len, seq_len = meta.query_lens[b], meta.seq_lens_host[b]
            chunk_window = window if window < seq_len else 0  # a window the chunk never outgrows masks nothing
            if self._prefill_kernel and kernels.prefill_attention(
                    q[start:start + q_len], kv_layer, meta.page_tables[b], seq_len - q_len, scale,
                    out[start:start + q_len], self._prefill_bf16, chunk_window, self._prefill_avx2):
                start += q_len
                continue
            if chunk_window:
                out[start:start + q_len] = self._windowed_chunk(kv_layer, q[start:start + q_len], meta.page_tables[b],
                                                                seq_len, chunk_window, scale, dtype)
                start += q_len
                continue
            num_pages = -(-seq_len // meta.page_size)
            kp, vp = gather_kv(kv_layer, meta.page_tables[b:b + 1, :num_pages], seq_len, dtype)
            qp = q[None, start:start + q_len]  # [1, q_len, H, D]
            if q_len == seq_len:
                out[start:start + q_len] = attend(qp, kp, vp, None, True, scale)[0]
            elif q.device.type == "cpu":
                out[start:start + q_len] = attend_after_prefix(qp, kp, vp, scale)[0]
            else:
                # Query i sits at position (seq_len - q_len + i) and sees every key up to and including it.
                q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
                k_pos = torch.arange(seq_len, device=q.device)
                mask = (k_pos[None, :] <= q_pos[:, None])[None, None]  # [1, 1, q_len, seq_len]
                out[start:start + q_len] = attend(qp, kp, vp, mask, False, scale)[0]
            start += q_len
        if v_scale != 1.0:
            out *= v_scale
        return out

    def _windowed_chunk(self, kv_layer: torch.Tensor, q: torch.Tensor, page_table: torch.Tensor, seq_len: int,
                        window: int, scale: float, dtype: torch.dtype | None) -> torch.Tensor:
        """A prefill chunk q [Lq, H, D] ending at seq_len, in a layer with a window: its keys from the first
        query's window on (the pages before it unread), query i at position seq_len - Lq + i seeing key j iff
        j <= i and i - j < window."""
        q_len, page_size = q.shape[0], kv_layer.shape[2]
        lo = max(0, seq_len - q_len - window + 1)  # the first key any query sees
        first_page, num_pages = lo // page_size, -(-seq_len // page_size)
        kp, vp = gather_kv(kv_layer, page_table[None, first_page:num_pages], seq_len - first_page * page_size, dtype)
        skip = lo - first_page * page_size  # the first page's slots before lo (they may hold anything)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(lo, seq_len, device=q.device)[None, :]
        mask = (k_pos <= q_pos) & (q_pos - k_pos < window)  # [Lq, seq_len - lo]
        return attend(q[None], kp[:, skip:], vp[:, skip:], mask[None, None], False, scale)[0]
