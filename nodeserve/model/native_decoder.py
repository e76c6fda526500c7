"""Decode-only steps of a block-quantized model on CPU, one native call per layer (ns_decode_layer in
nodeserve/kernels/csrc/cpu_kernels.c).

A batch-1 decode step through LlamaModel's modules is ~50 Python-level ops per layer; on one core their
dispatch cost was about a third of the step (bench/README.md). This runs the same kernels in the same order
with one call per layer, the way CUDA graphs replay a step on a GPU. LlamaModel.forward takes it for steps whose
every row decodes one token over a float32 pool; prefill chunks and mixed steps take the module path.

The C layer is the Llama layer (plus Qwen2's qkv bias) with the config's softmax scale and each layer's sliding
window (Mistral's), and what Qwen3 and Gemma 3 add to it as fields of its struct: q/k norms, sandwich norms, GeGLU,
a second RoPE table for windowed layers (the embedding scale is applied before the first layer).

Under tensor parallelism each rank's decoder holds its shard of every layer and passes `comm` (its rank in a
native group, device/collectives.py): the layer call all-reduces the o_proj and down_proj outputs in C.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Callable

import torch

from nodeserve.attention.base import AttentionBackend, AttentionMetadata
from nodeserve.kernels.native import NativeKernels

if TYPE_CHECKING:
    from nodeserve.device.collectives import RankComm

_i64, _f32, _i32, _p = ctypes.c_int64, ctypes.c_float, ctypes.c_int32, ctypes.c_void_p


class _Layer(ctypes.Structure):  # struct ns_layer
    _fields_ = [("hidden", _i64), ("num_heads", _i64), ("num_kv_heads", _i64), ("head_dim", _i64),
                ("intermediate", _i64), ("eps", _f32), ("input_norm", _p), ("post_norm", _p), ("qkv_bias", _p),
                ("qkv", _p), ("o", _p), ("gate_up", _p), ("down", _p), ("qkv_type", _i32), ("o_type", _i32),
                ("gate_up_type", _i32), ("down_type", _i32), ("window", _i64), ("q_norm", _p), ("k_norm", _p),
                ("attn_out_norm", _p), ("mlp_out_norm", _p), ("cos_sin", _p), ("gelu", _i64)]


class _Step(ctypes.Structure):  # struct ns_step
    _fields_ = [("num_rows", _i64), ("max_pages", _i64), ("page_size", _i64), ("positions", _p), ("slots", _p),
                ("page_tables", _p), ("seq_lens", _p), ("cos_sin", _p), ("scale", _f32), ("kv_f16", _i64),
                ("group", _p), ("rank", _i64)]


class NativeDecoder:
    def __init__(self, model, kernels: NativeKernels, cos_sin_cache: torch.Tensor,
                 local_cos_sin_cache: torch.Tensor | None = None):
        """model: a LlamaModel whose projections are fused QuantLinears (checked by `usable`). local_cos_sin_cache:
        the windowed layers' RoPE table where they have their own base (Gemma 3)."""
        cfg = model.cfg
        self.kernels, self.cos_sin_cache, self.local_cos_sin_cache = kernels, cos_sin_cache, local_cos_sin_cache
        self.scale = cfg.softmax_scale
        self._fn = kernels.lib.ns_decode_layer
        self._fn.restype, self._fn.argtypes = ctypes.c_int, [_p, _p, _p, _p]
        self.layers = []
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            bias = attn.qkv_proj.bias
            q_norm, k_norm = (attn.q_norm, attn.k_norm) if cfg.qk_norm else (None, None)
            # sandwich norms (Gemma): post_attention_layernorm is attention's output norm, the MLP's input one
            # is pre_feedforward_layernorm
            mlp_in_norm = layer.pre_feedforward_layernorm if cfg.sandwich_norm else layer.post_attention_layernorm
            attn_out = layer.post_attention_layernorm if cfg.sandwich_norm else None
            mlp_out = layer.post_feedforward_layernorm if cfg.sandwich_norm else None
            local = cfg.window(i) and local_cos_sin_cache is not None
            self.layers.append(_Layer(
                cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                cfg.rms_norm_eps, layer.input_layernorm.weight.data_ptr(),
                mlp_in_norm.weight.data_ptr(), None if bias is None else bias.data_ptr(),
                attn.qkv_proj.weight.data_ptr(), attn.o_proj.weight.data_ptr(), mlp.gate_up_proj.weight.data_ptr(),
                mlp.down_proj.weight.data_ptr(), *(m.qtype | m.decode_flag for m in (attn.qkv_proj, attn.o_proj,
                                                                          mlp.gate_up_proj, mlp.down_proj)),
                cfg.window(i), *(None if n is None else n.weight.data_ptr()
                                                       for n in (q_norm, k_norm, attn_out, mlp_out)),
                local_cos_sin_cache.data_ptr() if local else None, int(cfg.hidden_act == "gelu_tanh")))
        self._layer_array = (_Layer * len(self.layers))(*self.layers)
        self._model = model  # keeps the weights the structs point into alive

    @staticmethod
    def usable(model) -> bool:
        """Every projection block-quantized (fused qkv and gate/up) and only qkv with a bias (Qwen2). The C layer
        computes every family of model/registry.py: q/k norm, sandwich norms, GeGLU and a local RoPE table are
        fields of its struct (the embedding scale is applied before it)."""
        from nodeserve.model.block_quant import QuantLinear
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(isinstance(m, QuantLinear) for m in projections):
                return False
            if any(m.bias is not None for m in projections[1:]):
                return False
        return True

    def takes(self, x: torch.Tensor, backend: AttentionBackend) -> bool:
        """Whether the step `backend` was prepared for is one it runs: every row decodes one token, over a pool on
        the CPU whose dtype the kernels read (float32, or float16 with F16C), at positions the RoPE table covers (C
        indexes it unchecked)."""
        meta, kv_layers = backend.meta, backend.pool.layers
        return (meta is not None and meta.num_decodes == meta.num_seqs and x.device.type == "cpu"
                and x.dtype == torch.float32 and kv_layers[0].dtype in self.kernels.kv_dtypes
                and max(meta.seq_lens_host) <= len(self.cos_sin_cache))

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
                 on_layer_done: Callable[[int], None] | None = None, comm: RankComm | None = None) -> torch.Tensor:
        """x: [T, hidden] embeddings -> the residual stream after the last layer (before the final norm). Writes
        K/V into the backend's pool layers, at the slots of the step it was prepared for. comm: this rank of a
        tensor-parallel group (`.handle`, the native group's pointer, and `.rank`), whose peers call this at the
        same time on their shards; None alone."""
        group, rank = (None, 0) if comm is None else (comm.handle, comm.rank)
        if comm is not None and group is None and comm.num_ranks > 1:
            # the reduce happens inside the C call, so only a native group can do it (not ThreadAllReduce)
            raise ValueError("the native decoder needs a native all-reduce group (CPUAllReduce) to split a layer")
        meta, kv_layers, window_layers = backend.meta, backend.pool.layers, backend.pool.window_layers
        x = x.contiguous()
        positions = positions.contiguous()
        keep = []  # the tensors the C structs point into, alive until the calls return

        def step_of(m: AttentionMetadata) -> object:
            slots, tables, seq_lens = m.slot_mapping.contiguous(), m.page_tables.contiguous(), m.seq_lens.contiguous()
            keep.append((slots, tables, seq_lens))
            step = _Step(x.shape[0], tables.shape[1], m.page_size, positions.data_ptr(), slots.data_ptr(),
                         tables.data_ptr(), seq_lens.data_ptr(), self.cos_sin_cache.data_ptr(), self.scale,
                         int(kv_layers[0].dtype == torch.float16), group, rank)
            keep.append(step)
            return ctypes.byref(step)

        step_ptr, x_ptr = step_of(meta), x.data_ptr()
        # windowed layers read their own pages where the pool keeps them apart (kv/window.py)
        window_step_ptr = step_of(meta.for_window()) if window_layers else step_ptr
        if on_layer_done is None and not window_layers and _one_allocation(kv_layers):  # one call: ns_decode_layers
            layer_bytes = kv_layers[1].data_ptr() - kv_layers[0].data_ptr() if len(kv_layers) > 1 else 0
            if self.kernels.lib.ns_decode_layers(self._layer_array, len(self.layers), step_ptr, x_ptr,
                                                 kv_layers[0].data_ptr(), layer_bytes):
                raise RuntimeError("ns_decode_layer failed (out of memory, or a tensor-parallel peer failed)")
            return x
        for i, layer in enumerate(self.layers):
            if self._fn(ctypes.byref(layer), window_step_ptr if i in window_layers else step_ptr, x_ptr,
                        kv_layers[i].data_ptr()):
                raise RuntimeError("ns_decode_layer failed (out of memory, or a tensor-parallel peer failed)")
            if on_layer_done is not None:
                on_layer_done(i)
        return x


def _one_allocation(kv_layers) -> bool:
    """Whether the layers' K/V lie at one stride in one allocation (a KVShard's data.unbind(0)), as the one-call
    step addresses them."""
    if len(kv_layers) < 2:
        return True
    stride = kv_layers[1].data_ptr() - kv_layers[0].data_ptr()
    return stride > 0 and all(t.data_ptr() == kv_layers[0].data_ptr() + i * stride for i, t in enumerate(kv_layers))
