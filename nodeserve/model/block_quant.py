"""Block-quantized weights served as they are: GGUF's Q4_0, Q4_1 and Q8_0 blocks (32 weights, fp16 scale, and
for Q4_1 an fp16 offset), Q5_1 and the K-quants Q4_K, Q5_K, Q6_K (256-weight super-blocks with 6- or 8-bit
sub-block scales: kernels/csrc/kquant.c), multiplied by float32 activations in nodeserve's native CPU kernels.
Q5_0 is turned into Q8_0 once at load (to_kernel_layout): the same fp16 scale and q - 16 as int8 give the same
weights bit for bit, 34 bytes a block instead of 22, and then every Q8_0 path below (repacking included) runs it.

Decode on a CPU is bound by reading the weights: the bundled Q4_1 file's matrices are 0.625 bytes a weight where
float32 is 4. `model.quantization = "auto"` keeps a GGUF file's tensors of the types above in their blocks (the
weights llama.cpp computes with, bit for bit); "int8" and "int4" quantize any other weight to Q8_0 / Q4_1.
Other GGUF types (Q2_K, Q3_K, IQ*, TQ*, ...) are dequantized to float32 at load (model/gguf_loader.py).
Activations stay float32 for batched rows; a single row (batch-1 decode) is rounded to int16 per block of 32
inside the kernel (see cpu_kernels.c, kquant.c), far finer than llama.cpp's int8 activations.

Large batches (prefill chunks) dequantize the matrix to float32 and run torch's GEMM: compute-bound work goes
to the best GEMM the CPU has, and the dequantization costs a few percent of it.

On a CPU with AVX2 (FMA, F16C), repack() moves every Q4_0 / Q4_1 / Q8_0 matrix into 16-row groups (the same bytes)
for the integer GEMM, which rounds activations to int16 per 32-block and runs every row count, prefill chunks
included: kernels/csrc/vnni_gemm.c on AVX-512 VNNI (bench/kernels.py: 3-15x the float32 paths on batched rows),
kernels/csrc/r16_avx2.c's 256-bit kernels elsewhere (AVX-VNNI, or AVX2's vpmaddwd / vpmaddubsw), with the same
integer sums. With `model.prompt_activations = "int8"` (use_prompt_activations) a step's prompt rows take int8
activations instead, as llama.cpp rounds every row: twice vpdpwssd's multiply rate; with "bf16" (AVX512-BF16;
the default "auto" where the CPU has it), bf16 products over weights dequantized once a call
(kernels/csrc/bf16_gemm.c: no per-block scaling). Decode rows take `model.decode_activations` either way
(use_decode_activations: int16, or int8 by default where the kernels are AVX2's), so a decode token never depends
on what shares its step. NODESERVE_KERNELS=avx2 runs the AVX2 kernels (what an AVX2-only CPU runs) on any
CPU, for A/B measurements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from nodeserve.kernels import native

BLOCK_FORMATS = {"int8": native.Q8_0, "int4": native.Q4_1}
# GGUF types "auto" keeps in blocks: those the kernels read, and Q5_0 (to_kernel_layout makes it Q8_0)
KEPT_TYPES = frozenset(native.BLOCK_LAYOUTS) | {native.Q5_0}
# Rows up to which the fused kernel beats dequantize + GEMM (bench/kernels.py measures both; bench/README.md).
MAX_GEMV_ROWS = 32
MAX_REPACKED_ROWS = 1 << 20  # repacked weights: the VNNI kernel takes every step, in passes of 8 rows
ROWS_PER_PASS = 8  # activation rows per pass over a weight row (MAX_TILE in kernels/csrc/cpu_kernels.c)


@dataclass
class QuantizedWeight:
    """A [out_features, in_features] matrix as rows of GGUF blocks: data is uint8 [out, in / block weights * block
    bytes] (native.BLOCK_LAYOUTS)."""

    qtype: int
    data: torch.Tensor
    shape: tuple[int, int]

    def dequantize(self) -> torch.Tensor:
        return _kernels().dequantize(self.qtype, self.data, self.shape[1], num_rows=self.shape[0])


def type_name(qtype: int) -> str:
    """A ggml type id's name (Q4_K), for messages."""
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(qtype & 0xFF).name
    except ValueError:
        return str(qtype)


def _kernels() -> native.NativeKernels:
    kernels = native.load()
    if kernels is None:
        raise RuntimeError("block-quantized weights need nodeserve's CPU kernels, which could not be built "
                           "(see the log; install a C compiler)")
    return kernels


def available() -> bool:
    return native.load() is not None


def to_kernel_layout(weight: QuantizedWeight) -> QuantizedWeight:
    """`weight` in a type the kernels run: Q5_0 becomes Q8_0 (w = d * (q - 16) is Q8_0's d * q with the same
    fp16 d: lossless, 34 bytes a block instead of 22), Q4_0 stays (fuse() converts it where it must), the rest
    are returned as they are."""
    if weight.qtype != native.Q5_0:
        return weight
    n, k = weight.shape
    b = weight.data.numpy().reshape(n, k // 32, 22)
    hi = np.unpackbits(b[..., 2:6], axis=-1, bitorder="little") << 4  # [n, blocks, 32]: bit j of qh is quant j's
    lo = np.concatenate([b[..., 6:] & 0x0F, b[..., 6:] >> 4], axis=-1)  # quants 0..15: low nibbles, then high
    q = ((lo | hi).astype(np.int16) - 16).astype(np.int8).view(np.uint8)
    blocks = np.concatenate([b[..., :2], q], axis=-1).reshape(n, -1)
    return QuantizedWeight(native.Q8_0, torch.from_numpy(np.ascontiguousarray(blocks)), weight.shape)


def _q4_0_as_q8_0(weight: QuantizedWeight) -> QuantizedWeight:
    """Q4_0 (w = d * (q - 8)) as Q8_0 blocks with the same d: lossless, for fusing it with Q8_0 projections."""
    n, k = weight.shape
    b = weight.data.numpy().reshape(n, k // 32, 18)
    q = (np.concatenate([b[..., 2:] & 0x0F, b[..., 2:] >> 4], axis=-1).astype(np.int16) - 8).astype(np.int8)
    blocks = np.concatenate([b[..., :2], q.view(np.uint8)], axis=-1).reshape(n, -1)
    return QuantizedWeight(native.Q8_0, torch.from_numpy(np.ascontiguousarray(blocks)), weight.shape)


def quantize(weight: torch.Tensor, qtype: int) -> QuantizedWeight:
    """A float matrix [N, K] (K % 32 == 0) in Q8_0 (d = amax / 127) or Q4_1 (d = (max - min) / 15, m = min) blocks,
    with the quants computed against the fp16-rounded scales the kernels will read."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // 32, 32)
    if qtype == native.Q8_0:
        d = (w.abs().amax(-1) / 127).half()
        inv = torch.where(d > 0, 1 / d.float(), torch.zeros_like(d, dtype=torch.float32))
        q = (w * inv[..., None]).round().clamp(-127, 127).to(torch.int8)
        blocks = torch.cat([d.view(torch.uint8).reshape(n, -1, 2), q.view(torch.uint8)], -1)
    elif qtype == native.Q4_1:
        lo, hi = w.amin(-1), w.amax(-1)
        d, m = ((hi - lo) / 15).half(), lo.half()
        inv = torch.where(d > 0, 1 / d.float(), torch.zeros_like(d, dtype=torch.float32))
        q = ((w - m.float()[..., None]) * inv[..., None]).round().clamp(0, 15).to(torch.uint8)
        qs = q[..., :16] | (q[..., 16:] << 4)
        blocks = torch.cat([d.view(torch.uint8).reshape(n, -1, 2), m.view(torch.uint8).reshape(n, -1, 2), qs], -1)
    else:
        raise ValueError(f"cannot quantize to ggml type {qtype}")
    return QuantizedWeight(qtype, blocks.reshape(n, -1).contiguous(), (n, k))


class QuantLinear(nn.Module):
    """y = x @ W.T + b with W in blocks. x: [..., in] -> [..., out] float32."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.qtype = weight.qtype
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.data)  # uint8 blocks: counted in the replica's bytes
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        self.kernels = _kernels()
        self.prompt_flag = 0  # native.ACT8 or native.BF16: how prompt rows are multiplied (use_prompt_activations)
        self.decode_flag = 0  # native.ACT8: how decode rows are (use_decode_activations); 0: int16

    @property
    def quantized(self) -> QuantizedWeight:
        return QuantizedWeight(self.qtype, self.weight, (self.out_features, self.in_features))

    def forward(self, x: torch.Tensor, prompt_from: int | None = None) -> torch.Tensor:
        """prompt_from: x's rows from this one on are prompt tokens (the step's decode rows come first), which
        take the kernel prompt_flag asks for, the rows before it decode_flag's; None: every row is a decode row."""
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).float().contiguous()  # [M, in]
        y = self._matmul(x2, None if self._fused_kernel_takes(x2.shape[0]) else self._dense(), prompt_from)
        return y.view(*shape[:-1], self.out_features)

    def row_blocks(self, x: torch.Tensor, max_rows: int, prompt_from: int | None = None) -> Iterator[torch.Tensor]:
        """forward(x, prompt_from) of x [M, in] by blocks of at most max_rows rows, each [rows, out] in turn (the
        same values: every row's dot products are computed alike in any block); the weights are dequantized once
        if at all."""
        x = x.float().contiguous()
        dense = None if self._fused_kernel_takes(min(max_rows, x.shape[0])) else self._dense()
        for start in range(0, x.shape[0], max_rows):
            yield self._matmul(x[start:start + max_rows], dense,
                               None if prompt_from is None else max(prompt_from - start, 0))

    def _fused_kernel_takes(self, num_rows: int) -> bool:
        return num_rows <= MAX_GEMV_ROWS or bool(self.qtype & native.R16)

    def _dense(self) -> torch.Tensor:
        return self.kernels.dequantize(self.qtype, self.weight, self.in_features)

    def _matmul(self, x2: torch.Tensor, dense: torch.Tensor | None, prompt_from: int | None = None) -> torch.Tensor:
        """x2 [M, in] -> [M, out]: the fused kernel, or a GEMM with the dequantized weights `dense`."""
        if dense is not None:
            return F.linear(x2, dense, self.bias)
        m = x2.shape[0]
        split = m if prompt_from is None else min(prompt_from, m)  # rows [0, split) decode, [split, m) prompt
        if 0 < split < m and self.prompt_flag != self.decode_flag:
            y = torch.empty(m, self.out_features, dtype=torch.float32)
            self.kernels.linear(self.qtype | self.decode_flag, self.weight, x2[:split], self.out_features, y[:split])
            self.kernels.linear(self.qtype | self.prompt_flag, self.weight, x2[split:], self.out_features, y[split:])
        else:
            flag = self.decode_flag if split > 0 else self.prompt_flag
            y = self.kernels.linear(self.qtype | flag, self.weight, x2, self.out_features)
        if self.bias is not None:
            y += self.bias
        return y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, ggml_type={self.qtype}"


def gemv_rows(model: nn.Module) -> tuple[int, int]:
    """(max rows multiplied in passes over the weights, rows a pass) for the cost model's LinearKernels: a model
    with block-quantized linears runs small steps that way (repacked ones, every step); (0, 1) for one whose
    linears are all dense."""
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if linears and all(m.qtype & native.R16 for m in linears):
        return MAX_REPACKED_ROWS, ROWS_PER_PASS
    if linears:
        return MAX_GEMV_ROWS, ROWS_PER_PASS
    return 0, 1


def repack(model: nn.Module) -> int:
    """Moves every block-quantized linear and embedding of `model` into 16-row groups for the integer GEMMs, when
    this CPU's kernels have one (native.r16_kernel: AVX-512 VNNI, AVX-VNNI or AVX2; a table shared by the embedding
    and a tied lm_head is repacked once). Returns how many matrices were repacked."""
    kernels = native.load()
    kernel = None if kernels is None else native.r16_kernel(kernels)
    if kernel is None:
        return 0
    # the build's best kernel needs no flag (an AVX2-only CPU's qtype is plain type | R16); a forced one does
    flag = native.R16 | (0 if kernel == kernels.r16_kernels[0] else native.R16_FLAGS[kernel])
    repacked: dict[int, torch.Tensor] = {}
    for m in model.modules():  # Q5_1 and the K-quants keep their GGUF layout (kquant.c has no R16 kernel)
        if isinstance(m, (QuantLinear, QuantEmbedding)) and m.qtype in native.BLOCK_BYTES:
            n, k = (m.out_features, m.in_features) if isinstance(m, QuantLinear) else (m.num_embeddings,
                                                                                       m.embedding_dim)
            key = m.weight.data_ptr()
            if key not in repacked:
                repacked[key] = kernels.repack(m.qtype, m.weight, n, k)
            m.weight = repacked[key]
            m.qtype |= flag
    return len(repacked)


def use_prompt_activations(model: nn.Module, kind: str) -> int:
    """Prompt rows of repacked projections (not the lm_head, which sees only sampled rows) take `kind`
    ("int8": Q4_0 / Q4_1 ones, the integer kernels' int8 path; "bf16": every one, where the CPU has AVX512-BF16
    and the AVX-512 kernels serve) from now on. Returns how many projections do."""
    kernels = native.load()
    if kind == "int8":
        flag, types = native.ACT8, (native.Q4_0, native.Q4_1)
    elif kind == "bf16" and kernels is not None and kernels.bf16_gemm and native.r16_kernel(kernels) == "avx512-vnni":
        flag, types = native.BF16, (native.Q4_0, native.Q4_1, native.Q8_0)
    else:
        return 0
    projections = repacked_projections(model, types)
    for m in projections:
        m.prompt_flag = flag
    return len(projections)


def repacked_projections(model: nn.Module, types: tuple[int, ...]) -> list[QuantLinear]:
    """The model's projections repacked to R16 with one of these ggml types, but its lm_head."""
    return [m for m in model.modules() if isinstance(m, QuantLinear) and m is not getattr(model, "lm_head", None)
            and m.qtype & native.R16 and (m.qtype & 0xff) in types]


def decode_activations_for(setting: str) -> str:
    """model.decode_activations resolved for this CPU: "auto" is int8 where the integer kernels are AVX2's
    (vpmaddwd + vpaddd for 16 int16 multiply-adds: AVX2-only CPUs, the class where the batched figures lag), int16
    where they are VNNI's or there are none; "int16" and "int8" stay."""
    if setting != "auto":
        return setting
    kernels = native.load()
    return "int8" if kernels is not None and native.r16_kernel(kernels) == "avx2" else "int16"


def use_decode_activations(model: nn.Module, kind: str) -> int:
    """Decode rows (and verify rows) of repacked Q4_0 / Q4_1 projections take `kind` ("int8": the integer kernels'
    int8 path, llama.cpp's rounding of every row; "int16": the kernels' own) from now on; not the lm_head, whose rows
    include prompts' last ones. Returns how many projections take int8. Set before the native decoder is built: it
    copies each projection's type."""
    projections = repacked_projections(model, (native.Q4_0, native.Q4_1))
    for m in projections:
        m.decode_flag = native.ACT8 if kind == "int8" else 0
    return len(projections) if kind == "int8" else 0


class QuantEmbedding(nn.Module):
    """Rows of a block-quantized table, dequantized on lookup (the table may be shared with a tied lm_head)."""

    def __init__(self, weight: QuantizedWeight):
        super().__init__()
        self.qtype = weight.qtype
        self.num_embeddings, self.embedding_dim = weight.shape
        self.register_buffer("weight", weight.data)
        self.kernels = _kernels()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = ids.reshape(-1).to(torch.int64).contiguous()
        if rows.numel() and not 0 <= int(rows.min()) <= int(rows.max()) < self.num_embeddings:
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")  # C would read past the table
        out = self.kernels.dequantize(self.qtype, self.weight, self.embedding_dim, rows)
        return out.view(*ids.shape, self.embedding_dim)


def fuse(linears: list[nn.Module]) -> nn.Module | None:
    """One QuantLinear whose output is the given QuantLinears' outputs concatenated, or None when they can't
    share one: not all block-quantized, or in formats with no lossless common one (Q4_0 and Q8_0 share Q8_0;
    a K-quant mix such as Q4_K q/k with Q6_K v does not: the caller logs what it does instead)."""
    if not all(isinstance(m, QuantLinear) for m in linears) or any(m.qtype & native.R16 for m in linears):
        return None  # fused before repack(): 16-row groups need not line up
    weights = [m.quantized for m in linears]
    if len({w.qtype for w in weights}) > 1 and {w.qtype for w in weights} <= {native.Q4_0, native.Q8_0}:
        weights = [_q4_0_as_q8_0(w) if w.qtype == native.Q4_0 else w for w in weights]
    if len({w.qtype for w in weights}) != 1:
        return None
    data = torch.cat([w.data for w in weights])
    bias = None if linears[0].bias is None else torch.cat([m.bias for m in linears])
    return QuantLinear(QuantizedWeight(weights[0].qtype, data, (data.shape[0], linears[0].in_features)), bias)


def dense(module: nn.Module) -> nn.Linear:
    """A QuantLinear as a float32 nn.Linear with the same (dequantized) weights."""
    lin = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
    lin.weight = nn.Parameter(module.quantized.dequantize(), requires_grad=False)
    if module.bias is not None:
        lin.bias = nn.Parameter(module.bias.detach().clone(), requires_grad=False)
    return lin
