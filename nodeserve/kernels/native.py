"""Builds nodeserve's C kernels (csrc/*.c) for the CPU this process runs on, and calls them on tensors.

Why hand-written C: no maintained package runs GGUF's blocks (Q4_0/Q4_1/Q8_0; Q5_1 and the K-quants Q4_K/Q5_K/Q6_K
in csrc/kquant.c) with float32 activations from
torch on x86 (torch's weight-only int4/int8 kernels vectorise only for bf16 activations on AVX2 and are ~10x
slower with float32; llama.cpp's ggml is not a library one can call per op). Why ctypes: the file needs no
torch headers, so it compiles in about a second with the system C compiler, and ctypes releases the GIL
during each call, so the device workers' threads run their kernels in parallel.

The build is per machine: `-march=native` (NODESERVE_KERNELS_MARCH overrides it: `x86-64-v3` builds exactly what an
AVX2-only machine builds, which is how an AVX-512 machine runs and tests that class), cached under $NODESERVE_CACHE_DIR (default
$XDG_CACHE_HOME/nodeserve/kernels, else ~/.cache/nodeserve/kernels; a temporary directory when neither is
writable) by a key over the source, the compiler and the CPU's flags, so a cache that
moves to another CPU model is rebuilt instead of executing instructions the CPU lacks. Without a C compiler
(or if the build fails) load() returns None and callers use their torch paths.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from importlib import resources

import torch

from nodeserve.kernels import cpuinfo, tuning

log = logging.getLogger(__name__)

BLOCK_SIZE = 32

# ggml type ids of the block formats the kernels read (gguf.GGMLQuantizationType)
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}  # bytes per 32 weights: the types every path (R16 too) runs
# (weights, bytes) a block, for every type the GGUF-layout GEMM and dequantization read (Q5_1 and the K-quants:
# csrc/kquant.c). Q5_0 is not among them: block_quant.servable() turns it into Q8_0 at load.
BLOCK_LAYOUTS = {**{t: (BLOCK_SIZE, b) for t, b in BLOCK_BYTES.items()},
                 Q5_1: (32, 24), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}
R16 = 0x100  # type flag: weights repacked in 16-row groups for the integer kernels (csrc/vnni_gemm.c, r16_avx2.c)
ACT8 = 0x200  # type flag with R16: 8-bit activations for Q4_0 / Q4_1 (vnni_gemm.c's group_rows_i8); others 15-bit
BF16 = 0x400  # type flag with R16: bf16 products, weights dequantized per call (csrc/bf16_gemm.c)
R16_AVX2 = 0x800  # type flag with R16: the AVX2 kernels (vpmaddwd / vpmaddubsw, csrc/r16_avx2.c) in any build
R16_AVXVNNI = 0x1000  # type flag with R16: the 256-bit vpdpwssd / vpdpbusd kernels (r16_avx2.c)
# ns_r16_supported()'s bits: the R16 kernels a build has, best first, by the name the log and `isa` give them
R16_KERNELS = {1: "avx512-vnni", 4: "avx-vnni", 2: "avx2"}
R16_FLAGS = {"avx512-vnni": 0, "avx-vnni": R16_AVXVNNI, "avx2": R16_AVX2}  # the type flag that picks each

_i64, _ptr, _f32, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "ns_linear": (_int, [_int, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64]),
    "ns_dequant_rows": (None, [_int, _ptr, _i64, _ptr, _i64, _ptr]),
    "ns_paged_decode_attention": (_int, [_ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _f32,
                                         _int, _i64]),
    "ns_prefill_attention": (_int, [_ptr, _i64, _ptr, _ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _f32,
                                    _int, _int, _i64]),
    "ns_prefill_attention_avx2": (_int, [_ptr, _i64, _ptr, _ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _i64, _i64,
                                         _f32, _int, _int, _i64]),
    "ns_rms_norm": (None, [_ptr, _i64, _ptr, _ptr, _i64, _i64, _f32]),
    "ns_add_rms_norm": (None, [_ptr, _ptr, _ptr, _i64, _i64, _f32]),
    "ns_silu_and_mul": (None, [_ptr, _ptr, _i64, _i64]),
    "ns_rope": (None, [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64]),
    "ns_write_kv": (_int, [_ptr, _ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _int]),
    "ns_isa": (_int, []),
    "ns_r16_supported": (_int, []),
    "ns_prefill_supported": (_int, []),
    "ns_prefill_bf16_supported": (_int, []),
    "ns_prefill_avx2_supported": (_int, []),
    "ns_bf16_gemm_supported": (_int, []),
    "ns_r16_bytes": (_i64, [_int, _i64, _i64]),
    "ns_set_prefetch_levels": (None, [_int, _int]),
    "ns_repack_r16": (None, [_int, _ptr, _i64, _i64, _ptr]),
    "ns_helper_new": (_ptr, [_int]),
    "ns_helper_lend": (None, [_ptr, _int]),
    "ns_helper_want": (None, [_ptr, _int]),
    "ns_helper_use": (None, [_ptr]),
    "ns_helper_jobs": (ctypes.c_long, [_ptr]),
    "ns_helper_free": (None, [_ptr]),
    "ns_decode_layers": (_int, [_ptr, _i64, _ptr, _ptr, _ptr, _i64]),
    "ns_group_new": (_ptr, [_i64]),
    "ns_group_free": (None, [_ptr]),
    "ns_group_spins": (None, [_ptr, _i64]),
    "ns_group_allreduce": (_int, [_ptr, _i64, _ptr, _i64]),
    "ns_group_abort": (None, [_ptr]),
    "ns_group_reset": (None, [_ptr]),
}


def _cpu_flags(path: str = "/proc/cpuinfo") -> str:
    """The first processor's identity and ISA flags, for the build's cache key. Both: the model name alone (what
    the key took before) is "AMD EPYC" on Zen 3 and Zen 4 VMs alike, so a cache two such hosts share would hand an
    AVX-512 build to the one without."""
    fields = cpuinfo.first_processor(path)
    if fields:
        return f"{cpuinfo.identity(fields)} | {' '.join(sorted(cpuinfo.isa_flags(fields) or ()))}"
    import platform
    return platform.processor() or platform.machine()


def cache_root() -> str:
    """nodeserve's cache folder: $XDG_CACHE_HOME/nodeserve (default ~/.cache/nodeserve)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "nodeserve")


def _cache_dir() -> str:
    if os.environ.get("NODESERVE_CACHE_DIR"):
        return os.environ["NODESERVE_CACHE_DIR"]
    return os.path.join(cache_root(), "kernels")


def march() -> str:
    """The -march the kernels are built for: NODESERVE_KERNELS_MARCH, else native."""
    return os.environ.get("NODESERVE_KERNELS_MARCH") or "native"


# The compiler's macros for the ISA extensions the kernels test (csrc/*.c), by /proc/cpuinfo's names for them.
_FEATURE_MACROS = {"__AVX2__": "avx2", "__FMA__": "fma", "__F16C__": "f16c", "__AVX512F__": "avx512f",
                   "__AVX512BW__": "avx512bw", "__AVX512VL__": "avx512vl", "__AVX512DQ__": "avx512dq",
                   "__AVX512CD__": "avx512cd", "__AVX512VNNI__": "avx512_vnni", "__AVXVNNI__": "avx_vnni",
                   "__AVX512BF16__": "avx512_bf16", "__AMX_BF16__": "amx_bf16"}


def target_features(cc: str, arch: str) -> frozenset[str]:
    """The ISA extensions of the CPU the kernels are built for, as the compiler defines them for -march=arch: with
    native, this CPU's (as far as the compiler knows them), so a build never claims what the CPU lacks."""
    try:
        macros = subprocess.run([cc, f"-march={arch}", "-dM", "-E", "-x", "c", os.devnull], capture_output=True,
                                text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return frozenset()
    defined = {line.split()[1] for line in macros.splitlines() if line.startswith("#define ")}
    return frozenset(name for macro, name in _FEATURE_MACROS.items() if macro in defined)


def _compile(cc: str, srcs: list[str], out: str) -> None:
    flags = ["-O3", f"-march={march()}", "-fPIC", "-shared", "-std=c11", "-fno-math-errno", "-pthread"]
    tmp_dir = os.path.dirname(out)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=tmp_dir)
    os.close(fd)
    try:
        subprocess.run([cc, *flags, *srcs, "-o", tmp, "-lm"], check=True, capture_output=True, text=True,
                       timeout=120)
        os.replace(tmp, out)  # atomic: processes building at once never load a half-written file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class NativeKernels:
    """The loaded library. Methods take contiguous CPU tensors of the shapes they name and do not check them:
    C reads raw pointers, so callers (QuantLinear, QuantEmbedding, NativeOps, the attention backend) own that."""

    def __init__(self, lib: ctypes.CDLL, path: str, features: frozenset[str] = frozenset()):
        self.lib, self.path = lib, path
        self.features = features  # the build target's ISA extensions (target_features): what tests skip on
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        bits = lib.ns_r16_supported()
        # the integer GEMMs over repacked weights this build has (R16_KERNELS' names, best first)
        self.r16_kernels = tuple(name for bit, name in R16_KERNELS.items() if bits & bit)
        self.r16 = bool(self.r16_kernels)
        # the prefill attention (csrc/prefill_attn.c): AVX-512, or AVX2 + FMA + F16C (prefill_attn_avx2.c)
        self.prefill = bool(lib.ns_prefill_supported())
        # the AVX2 one, callable on its own (avx2=True) in AVX-512 builds too: what NODESERVE_KERNELS=avx2 runs
        self.prefill_avx2 = bool(lib.ns_prefill_avx2_supported())
        # which one a plain call runs, for the start-up log
        self.prefill_isa = ("avx512" if "avx512f" in features or not self.prefill_avx2 else "avx2") \
            if self.prefill else None
        self.prefill_bf16 = bool(lib.ns_prefill_bf16_supported())  # ... with bf16 products (AVX512-BF16)
        # R16 weights x bf16 (csrc/bf16_gemm.c): AVX-512 VNNI and BF16
        self.bf16_gemm = bool(bits & 1) and bool(lib.ns_bf16_gemm_supported())
        self.isa = self.r16_kernels[0] if self.r16 else {2: "avx2", 0: "scalar"}[lib.ns_isa()]
        self.kv_dtypes = (torch.float32, torch.float16) if lib.ns_isa() else (torch.float32,)  # float16: F16C
        # which cache the prefetches fill (tuning.py): the C default (L2 for both) until load() chooses
        self.prefetch = tuning.PrefetchLevels(True, True, "default")

    def repack(self, qtype: int, weight: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
        """GGUF blocks uint8 [N, K / 32 * block bytes] -> the same weights in 16-row groups (type qtype | R16),
        as uint8 [ceil(N / 16), bytes a group]."""
        num_bytes = self.lib.ns_r16_bytes(qtype, out_features, in_features)
        out = torch.empty((out_features + 15) // 16, num_bytes // ((out_features + 15) // 16), dtype=torch.uint8)
        self.lib.ns_repack_r16(qtype, weight.data_ptr(), out_features, in_features, out.data_ptr())
        return out

    def linear(self, qtype: int, weight: torch.Tensor, x: torch.Tensor, out_features: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] float32 @ W[N, K]^T -> [M, N] (into `out`, contiguous, when given); weight: GGUF blocks as
        uint8 [N, K / block weights * block bytes] (BLOCK_LAYOUTS), or repacked (R16)."""
        m, k = x.shape
        y = torch.empty(m, out_features, dtype=torch.float32) if out is None else out
        if self.lib.ns_linear(qtype, weight.data_ptr(), x.data_ptr(), y.data_ptr(), m, k, out_features, 0,
                              out_features):
            raise MemoryError("ns_linear: out of memory")
        return y

    def dequantize(self, qtype: int, weight: torch.Tensor, in_features: int,
                   rows: torch.Tensor | None = None, num_rows: int | None = None) -> torch.Tensor:
        """The rows `rows` (int64 [R]; when None, the first num_rows, by default every row of GGUF blocks) of a
        block-quantized matrix as float32 [R, in_features]."""
        n = rows.numel() if rows is not None else weight.shape[0] if num_rows is None else num_rows
        out = torch.empty(n, in_features, dtype=torch.float32)
        self.lib.ns_dequant_rows(qtype, weight.data_ptr(), in_features, None if rows is None else rows.data_ptr(),
                                 n, out.data_ptr())
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [T, H] (rows may be strided) -> [T, H]."""
        t, h = x.shape
        out = torch.empty(t, h, dtype=torch.float32)
        self.lib.ns_rms_norm(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), t, h, eps)
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        """In place on contiguous [T, H] tensors: residual += x; x = rms_norm(residual)."""
        self.lib.ns_add_rms_norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), *x.shape, eps)

    def silu_and_mul(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[T, 2I] contiguous -> [T, I], into out (float32, contiguous) when given."""
        t, i2 = gate_up.shape
        if out is None:
            out = torch.empty(t, i2 // 2, dtype=torch.float32)
        elif out.shape != (t, i2 // 2) or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError(f"silu_and_mul: out must be a contiguous float32 [{t}, {i2 // 2}], got "
                             f"{out.dtype} {tuple(out.shape)}")
        self.lib.ns_silu_and_mul(gate_up.data_ptr(), out.data_ptr(), t, i2 // 2)
        return out

    def rope(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
        """In place: q [T, H, D], k [T, KH, D] (heads and D contiguous, rows strided), positions int64 [T]."""
        t, h, d = q.shape
        self.lib.ns_rope(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), positions.data_ptr(),
                         cos_sin.data_ptr(), t, h, k.shape[1], d)

    def write_kv(self, kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v [T, KH, D] float32 (heads and D contiguous, rows strided) into a pool layer of one of kv_dtypes at
        int64 slots (float16 rounded to nearest)."""
        t, kh, d = k.shape
        if self.lib.ns_write_kv(kv_layer.data_ptr(), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                                slots.data_ptr(), t, kh, d, kv_layer.shape[2], _is_f16(kv_layer)):
            raise ValueError(f"ns_write_kv: no kernel for a {kv_layer.dtype} pool in this build")

    def paged_decode_attention(self, q: torch.Tensor, kv_layer: torch.Tensor, page_tables: torch.Tensor,
                               seq_lens: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
        """q [B, H, D] float32, kv_layer [P, 2, page_size, KH, D] of one of kv_dtypes, page_tables [B, max_pages]
        int64, seq_lens [B] int64 -> [B, H, D]. window > 0: each row sees its last `window` positions (its own
        included), and no slot before them is read."""
        b, h, d = q.shape
        out = torch.empty_like(q)
        if self.lib.ns_paged_decode_attention(
                q.data_ptr(), kv_layer.data_ptr(), page_tables.data_ptr(), page_tables.shape[1],
                seq_lens.data_ptr(), out.data_ptr(), b, h, kv_layer.shape[3], d, kv_layer.shape[2], scale,
                _is_f16(kv_layer), window):
            raise MemoryError("ns_paged_decode_attention: out of memory")
        return out

    def prefill_attention(self, q: torch.Tensor, kv_layer: torch.Tensor, page_table: torch.Tensor, num_prefix: int,
                          scale: float, out: torch.Tensor, bf16: bool = False, window: int = 0,
                          avx2: bool = False) -> bool:
        """out [Lq, H, D] = causal attention of q [Lq, H, D] (float32; heads and D contiguous, rows strided), the
        tokens after num_prefix cached ones of the sequence whose pages are page_table (int64, contiguous), over
        a pool layer [P, 2, page_size, KH, D] of one of kv_dtypes. False (out untouched) where the kernel is not built
        (neither AVX-512 nor AVX2 + FMA + F16C; with bf16, no AVX512-BF16) or does not take these shapes. bf16: the
        products in bf16 (vdpbf16ps), the sums and the softmax in float32. window > 0: each query sees its last `window` positions
        (its own included), and no slot before the first query's window is read. avx2: the AVX2 kernel even where
        the AVX-512 one is built (no bf16 products; False where it is not built)."""
        lq, h, d = q.shape
        if (q.stride()[1:] != (d, 1) or out.stride()[1:] != (d, 1) or page_table.dtype != torch.int64
                or not page_table.is_contiguous()):
            return False
        fn = self.lib.ns_prefill_attention_avx2 if avx2 else self.lib.ns_prefill_attention
        return fn(
            q.data_ptr(), q.stride(0), kv_layer.data_ptr(), page_table.data_ptr(), num_prefix, lq, out.data_ptr(),
            out.stride(0), h, kv_layer.shape[3], d, kv_layer.shape[2], scale, _is_f16(kv_layer), int(bf16),
            window) == 0


def _is_f16(kv_layer: torch.Tensor) -> int:
    return int(kv_layer.dtype == torch.float16)


def avx2_only() -> bool:
    """NODESERVE_KERNELS=avx2: run what an AVX2 machine runs (the R16 GEMMs' AVX2 kernels, no bf16 products, the AVX2
    prefill attention) on an AVX-512 one, for A/B measurements. Read when weights are repacked and when attention
    backends are built."""
    return os.environ.get("NODESERVE_KERNELS", "") == "avx2"


def r16_kernel(kernels: NativeKernels) -> str | None:
    """The R16 kernels repacked weights are served with (R16_KERNELS' name; R16_FLAGS gives its type flag): the
    build's best, the AVX2 ones under NODESERVE_KERNELS=avx2; None where the build has none (or, forced to AVX2,
    lacks AVX2)."""
    if avx2_only():
        return "avx2" if "avx2" in kernels.r16_kernels else None
    return kernels.r16_kernels[0] if kernels.r16 else None


def _gemv_workload(kernels: NativeKernels) -> tuning.Workload:
    """One activation row through as many 1024 -> 4096 Q4_1 matrices (R16, the kernel this build serves with) as
    tuning.FOOTPRINT_BYTES holds: a batch-1 decode step's GEMVs, for timing the weights' prefetch level."""
    n, k = 4096, 1024
    block, size = BLOCK_LAYOUTS[Q4_1]
    raw = torch.randint(0, 256, (n, k // block, size), dtype=torch.uint8)
    raw[..., 0:4] = torch.tensor([0x00, 0x20, 0x00, 0x00], dtype=torch.uint8)  # d = 2^-7 (fp16 0x2000), m = 0: finite
    packed = kernels.repack(Q4_1, raw.reshape(n, -1), n, k)
    qtype = Q4_1 | R16 | R16_FLAGS[r16_kernel(kernels) or kernels.r16_kernels[0]]
    ring = [packed.clone() for _ in range(max(2, tuning.FOOTPRINT_BYTES // packed.numel()))]
    x, out = torch.randn(1, k), torch.empty(1, n)

    def run() -> None:
        for w in ring:
            kernels.linear(qtype, w, x, n, out)
    return run


@functools.cache
def load() -> NativeKernels | None:
    """The kernels built for this CPU (built on first call, then cached on disk), or None if they can't be."""
    if not (torch.backends.cpu.get_cpu_capability() and os.name == "posix"):
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        log.warning("no C compiler found: CPU kernels for quantized weights and paged decode attention are off "
                    "(install gcc for them)")
        return None
    csrc = resources.files("nodeserve.kernels") / "csrc"
    files = sorted((p for p in csrc.iterdir() if p.name.endswith((".c", ".h"))), key=lambda p: p.name)
    srcs = [str(p) for p in files if p.name.endswith(".c")]
    source = b"".join(p.read_bytes() for p in files)  # headers too: an edit to one rebuilds
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    key = hashlib.sha256(source + version.encode() + _cpu_flags().encode() + march().encode()).hexdigest()[:16]
    cache = _cache_dir()
    try:
        os.makedirs(cache, exist_ok=True)
    except OSError:
        pass
    if not os.access(cache, os.W_OK):  # a read-only home (a locked-down service): build for this process only
        cache = tempfile.mkdtemp(prefix="nodeserve-kernels-")
    path = os.path.join(cache, f"cpu_kernels-{key}.so")
    try:
        if not os.path.exists(path):
            _compile(cc, srcs, path)
        kernels = NativeKernels(ctypes.CDLL(path), path, target_features(cc, march()))
        kernels.prefetch = tuning.choose(kernels, path[:-len(".so")] + ".prefetch.json",
                                         (lambda: _gemv_workload(kernels)) if kernels.r16 else None)
    except subprocess.CalledProcessError as e:
        log.warning("building the CPU kernels failed, using torch paths: %s", (e.stderr or "").strip()[-500:])
        return None
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("building the CPU kernels failed, using torch paths: %s", e)
        return None
    log.info("CPU kernels: %s (%s; %s)", path, kernels.isa, kernels.prefetch.describe())
    return kernels
