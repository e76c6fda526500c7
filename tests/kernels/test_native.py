"""The native CPU kernels (nodeserve/kernels): each against the torch computation it replaces."""

from __future__ import annotations

import os
import shutil
import time

import numpy as np
import pytest
import torch

from nodeserve.kernels import native

kernels = native.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="the native kernels could not be built (no C compiler?)")

TYPES = {"Q4_0": native.Q4_0, "Q4_1": native.Q4_1, "Q8_0": native.Q8_0}


def gguf_blocks(w: np.ndarray, name: str) -> torch.Tensor:
    """w [N, K] float32 quantized by the gguf package (llama.cpp's reference quantizer): uint8 [N, row bytes]."""
    import gguf
    from gguf.quants import quantize

    return torch.from_numpy(np.ascontiguousarray(quantize(w, gguf.GGMLQuantizationType[name])))


def gguf_dense(blocks: torch.Tensor, name: str, k: int) -> torch.Tensor:
    import gguf
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(blocks.numpy(), gguf.GGMLQuantizationType[name]).reshape(-1, k).copy())


# Where each type's quants lie in a block ([start, end) bytes). The kernels split a weight as w = s * q + o per
# group of 16 or 32 and multiply only s * q by the rounded activations (o by the exact float sum of the group), so
# the int16 rounding bounds below weigh |s * q|, not |w|. Q6_K's and Q8_0's quants are signed (o = 0).
QUANT_BYTES = {"Q4_0": (2, 18), "Q4_1": (4, 20), "Q5_1": (4, 24), "Q4_K": (16, 144), "Q5_K": (16, 176)}


def rounded_part(blocks: torch.Tensor, name: str, k: int) -> torch.Tensor:
    """s * q of every weight [N, K]: the weights less their groups' offsets o (the weights of all-zero quants)."""
    dense = gguf_dense(blocks, name, k)
    if name not in QUANT_BYTES:
        return dense
    start, end = QUANT_BYTES[name]
    qtype = getattr(native, name)
    zeroed = blocks.clone().view(blocks.shape[0], -1, native.BLOCK_LAYOUTS[qtype][1])  # [N, blocks, bytes]
    zeroed[..., start:end] = 0
    return dense - gguf_dense(zeroed.reshape(blocks.shape[0], -1), name, k)


@pytest.fixture(scope="module")
def matrices():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((40, 96)) * rng.uniform(0.01, 2, (40, 1))).astype(np.float32)
    w[3] = 0.0  # an all-zero row: scale 0
    return {name: gguf_blocks(w, name) for name in TYPES}


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_is_bit_exact_with_gguf(matrices, name):
    blocks = matrices[name]
    want = gguf_dense(blocks, name, 96)
    assert torch.equal(kernels.dequantize(TYPES[name], blocks, 96), want)
    rows = torch.tensor([5, 0, 39, 5])
    assert torch.equal(kernels.dequantize(TYPES[name], blocks, 96, rows), want[rows])


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("m", [2, 3, 8, 9, 17])
def test_linear_is_float32_math_on_the_blocks_weights(matrices, name, m):
    torch.manual_seed(m)
    x = torch.randn(m, 96)
    want = x @ gguf_dense(matrices[name], name, 96).T
    got = kernels.linear(TYPES[name], matrices[name], x, 40)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", TYPES)
def test_one_row_rounds_activations_to_int16_per_block(matrices, name):
    """Batch-1 decode: activations are rounded to 15 bits per block of 32, so each output is within
    sum_b |s q_b| * amax(x_b) / 32767 / 2 of the float32 product (rounded_part), and far closer than int8 activations."""
    torch.manual_seed(1)
    x = torch.randn(1, 96) * torch.logspace(-2, 1, 96)  # blocks of very different scales
    dense = gguf_dense(matrices[name], name, 96)
    want = x @ dense.T
    got = kernels.linear(TYPES[name], matrices[name], x, 40)
    xb = x.view(1, 3, 32).abs().amax(-1)  # [1, blocks]
    sq = rounded_part(matrices[name], name, 96).abs()  # [40, 96]
    bound = (sq.view(40, 3, 32).sum(-1) * xb / 32767 / 2).sum(-1) + 1e-5  # [40]
    assert ((got - want).abs()[0] <= bound).all()
    assert not torch.equal(got, want)  # the rounding is real


@pytest.mark.parametrize("m", [1, 4])
def test_linear_on_raw_random_blocks(m):
    """Any bytes are a valid block (fp16 scales kept finite): the kernel reads every field where gguf does."""
    torch.manual_seed(2)
    for name, qtype in TYPES.items():
        blocks = torch.randint(0, 256, (16, 64 // 32 * native.BLOCK_BYTES[qtype]), dtype=torch.uint8)
        view = blocks.view(16, 2, -1)
        scales = (torch.rand(16, 2, 2 if name == "Q4_1" else 1) * 0.1).half().view(torch.uint8).view(16, 2, -1)
        view[..., :scales.shape[-1]] = scales
        x = torch.randn(m, 64)
        want = x @ gguf_dense(blocks, name, 64).T
        got = kernels.linear(qtype, blocks, x, 16)
        tol = 1e-3 * want.abs().max().item() if m == 1 else 2e-4  # one row: int16 activations (test above)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


needs_f16c = pytest.mark.needs_cpu("avx2", "fma", "f16c")  # float16 pools: the AVX2 build's loads
needs_v4 = pytest.mark.needs_cpu("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd")  # -march=x86-64-v4


def build_for(march: str) -> native.NativeKernels:
    """The kernels built for one -march (NODESERVE_KERNELS_MARCH), cached on disk like any build."""
    if march == "native":
        return kernels
    old = os.environ.get("NODESERVE_KERNELS_MARCH")
    os.environ["NODESERVE_KERNELS_MARCH"] = march
    try:
        built = native.load.__wrapped__()
    finally:
        if old is None:
            del os.environ["NODESERVE_KERNELS_MARCH"]
        else:
            os.environ["NODESERVE_KERNELS_MARCH"] = old
    if built is None:
        pytest.skip(f"the kernels could not be built for -march={march}")
    return built


# Every R16 kernel this machine can run, by (build, kernel): the native build's own (AVX-512 VNNI, the 256-bit
# VNNI kernels, AVX2), an AVX-512 CPU without VNNI's (x86-64-v4: Skylake-SP) and an AVX2-only CPU's (x86-64-v3).
R16_CASES = [pytest.param(("native", name), id=f"native-{name}") for name in (kernels.r16_kernels if kernels else ())]
R16_CASES += [pytest.param(("x86-64-v4", "avx2"), marks=needs_v4, id="x86-64-v4-avx2"),
              pytest.param(("x86-64-v3", "avx2"), marks=needs_f16c, id="x86-64-v3-avx2")]


@pytest.fixture(scope="module", params=R16_CASES)
def r16(request):
    """(kernels, type flags): one R16 kernel of one build; type | flags runs it on weights that build repacked."""
    march, name = request.param
    built = build_for(march)
    assert name in built.r16_kernels, (march, built.r16_kernels)
    return built, native.R16 | native.R16_FLAGS[name]


@needs_f16c  # an x86 machine whose compiler knows the class (nothing of the build runs)
def test_an_avx_vnni_cpus_build_has_the_256_bit_vnni_kernels_in_vex():
    """Alder Lake's class (AVX-VNNI, no AVX-512): its build serves R16 with the 256-bit VNNI kernels, and they are
    VEX-encoded vpdpwssd / vpdpbusd (what such a CPU executes; the EVEX forms this machine tests the same code with
    would SIGILL there). Built and inspected only: nothing of it runs here."""
    import subprocess

    built = build_for("alderlake")
    assert built.r16_kernels == ("avx-vnni", "avx2") and built.isa == "avx-vnni" and "avx_vnni" in built.features
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", built.path], capture_output=True, text=True,
                          check=True).stdout
    assert "{vex} vpdpbusd" in text and "{vex} vpdpwssd" in text and "%zmm" not in text


@pytest.mark.parametrize("name", TYPES)
def test_repacked_weights_dequantize_to_the_files_weights(r16, matrices, name):
    """16-row groups (40 rows: the last group padded) hold the same weights, bit for bit, row by row."""
    build, flags = r16
    packed = build.repack(TYPES[name], matrices[name], 40, 96)
    assert packed.shape[0] == 3
    want = gguf_dense(matrices[name], name, 96)
    assert torch.equal(build.dequantize(TYPES[name] | flags, packed, 96, num_rows=40), want)
    rows = torch.tensor([39, 0, 16, 15, 17])
    assert torch.equal(build.dequantize(TYPES[name] | flags, packed, 96, rows), want[rows])


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 8, 12, 13, 20])
def test_repacked_linear_rounds_activations_to_int16_per_block(r16, matrices, name, m):
    """Every row count: activations rounded to 15 bits per block of 32, so each output is within
    sum_b |s q_b| * amax(x_b) / 32767 / 2 of the float32 product (rounded_part; and padded rows are never written)."""
    build, flags = r16
    torch.manual_seed(m)
    x = torch.randn(m, 96) * torch.logspace(-2, 1, 96)
    dense = gguf_dense(matrices[name], name, 96)
    want = x @ dense.T
    packed = build.repack(TYPES[name], matrices[name], 40, 96)
    got = build.linear(TYPES[name] | flags, packed, x, 40)
    xb = x.view(m, 3, 32).abs().amax(-1)                                      # [m, blocks]
    sq = rounded_part(matrices[name], name, 96).abs()  # [40, 96]
    bound = (sq.view(40, 3, 32).sum(-1)[None] * xb[:, None] / 32767 / 2).sum(-1) + 1e-5  # [m, 40]
    assert ((got - want).abs() <= bound).all()
    assert not torch.equal(got, want)
    if m == 1:  # the same rounding as the AVX2 path's one-row kernel on the GGUF layout (float sums reordered)
        torch.testing.assert_close(got, build.linear(TYPES[name], matrices[name], x, 40), rtol=1e-5,
                                   atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("name", TYPES)
def test_a_repacked_row_is_the_same_in_any_tile(r16, matrices, name):
    """Tiles of every size (AVX-512: up to 4 rows with four chains a row, 5-12 with one; 256-bit: 1-2 rows over
    both halves of a group, 3-6 a half at a time) sum in the same order: a row's output is bit-identical whatever
    the step's row count, so a request's tokens do not depend on its batch."""
    build, flags = r16
    torch.manual_seed(0)
    x = torch.randn(25, 96)
    packed = build.repack(TYPES[name], matrices[name], 40, 96)
    whole = build.linear(TYPES[name] | flags, packed, x, 40)
    for m in (1, 2, 3, 4, 5, 6, 7, 9, 12, 16):
        assert torch.equal(build.linear(TYPES[name] | flags, packed, x[:m], 40), whole[:m]), m


def int8_reference(blocks: torch.Tensor, name: str, x: torch.Tensor) -> torch.Tensor:
    """The scalar reference of the ACT8 path (float64 sums): x rounded per 32-block to int8 (d = amax / 127 and
    x / d rounded half to even, both in float32 as the kernel does), then per block d_w dx sum((q - 8) xq) +
    (m + 8 d_w) sum(x), with q the block's nibbles and w = d_w q + m (Q4_0: m = -8 d_w)."""
    n, k = blocks.shape[0], x.shape[1]
    raw = blocks.numpy().reshape(n, k // 32, -1)
    d_w = raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)                      # [N, nb]
    m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64) if name == "Q4_1" else -8 * d_w
    qs = raw[..., 4:] if name == "Q4_1" else raw[..., 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float64)                       # [N, nb, 32]
    xb = x.numpy().astype(np.float32).reshape(len(x), k // 32, 32)
    d = np.abs(xb).max(-1, keepdims=True) / np.float32(127)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), np.float32(0)).astype(np.float32)
    xq = np.clip(np.rint(xb * inv), -127, 127).astype(np.float64)                              # [M, nb, 32]
    dot = np.einsum("nbk,mbk->mnb", q - 8, xq)                                                 # [M, N, nb]
    y = (d_w[None] * d[..., 0].astype(np.float64)[:, None] * dot).sum(-1)
    y += np.einsum("nb,mb->mn", m + 8 * d_w, xb.astype(np.float64).sum(-1))
    return torch.from_numpy(y)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("m", [1, 2, 5, 12, 13, 40])
def test_int8_activation_rows_match_the_scalar_reference(r16, matrices, name, m):
    """ACT8: the vpdpbusd GEMM (or vpmaddubsw + vpmaddwd on AVX2) equals its scalar reference up to float32
    rounding of the block sums (it rounds activations to 8 bits, so it is far from the float product: 100x the
    int16 path's distance)."""
    build, flags = r16
    torch.manual_seed(m)
    x = torch.randn(m, 96) * torch.logspace(-2, 1, 96)
    packed = build.repack(TYPES[name], matrices[name], 40, 96)
    got = build.linear(TYPES[name] | flags | native.ACT8, packed, x, 40)
    want = int8_reference(matrices[name], name, x)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    int16 = build.linear(TYPES[name] | flags, packed, x, 40)
    exact = x.double() @ gguf_dense(matrices[name], name, 96).double().T
    assert (got.double() - exact).abs().max() > 10 * (int16.double() - exact).abs().max()


def test_int8_activations_reach_the_largest_pair_sums_exactly(r16):
    """Nibbles of 15 against activations of +-127 in every lane: vpmaddubsw's int16 pair sums (3,810) and their
    sum over a block (30,480) are at their largest and must neither saturate nor wrap."""
    build, flags = r16
    n, k = 16, 64
    blocks = torch.zeros(n, k // 32, 18, dtype=torch.uint8)  # Q4_0
    blocks[..., :2] = torch.tensor([0.5], dtype=torch.float16).view(torch.uint8)
    blocks[..., 2:] = 0xFF  # every quant 15: w = 0.5 * (15 - 8)
    blocks = blocks.reshape(n, -1)
    x = torch.full((3, k), 2.0)
    x[1] = -2.0
    x[2, ::2] = -2.0  # alternating signs: pair sums of 0
    packed = build.repack(native.Q4_0, blocks, n, k)
    got = build.linear(native.Q4_0 | flags | native.ACT8, packed, x, n)
    want = int8_reference(blocks, "Q4_0", x).float()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-4)
    assert torch.equal(got[0], torch.full((n,), 0.5 * 7 * 2 * k))


def test_int8_activations_leave_q8_0_weights_at_int16(r16, matrices):
    """Q8_0 blocks (signed weights: no unsigned operand for vpdpbusd) ignore ACT8 and round to int16."""
    build, flags = r16
    x = torch.randn(13, 96)
    packed = build.repack(native.Q8_0, matrices["Q8_0"], 40, 96)
    assert torch.equal(build.linear(native.Q8_0 | flags | native.ACT8, packed, x, 40),
                       build.linear(native.Q8_0 | flags, packed, x, 40))


@pytest.mark.parametrize("act8", [0, native.ACT8], ids=["int16", "int8"])
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 6, 7, 13, 32])
def test_every_r16_kernel_is_the_native_best_kernel_up_to_float_sum_order(r16, name, m, act8):
    """Parity across the CPU classes: each R16 kernel of each build (AVX2 on x86-64-v3, the 256-bit VNNI one, ...)
    computes the same integer sums as the native build's best (AVX-512 VNNI on this class of machine) and the same
    float operations on them, so it gives its result up to the order of a block's float sum; over 37 rows (a
    partial last group: a half with 5 rows, one with none) and K = 576, SmolLM2's width."""
    build, flags = r16
    rng = np.random.default_rng(m)
    w = (rng.standard_normal((37, 576)) * rng.uniform(0.01, 2, (37, 1))).astype(np.float32)
    blocks = gguf_blocks(w, name)
    x = torch.from_numpy(rng.standard_normal((m, 576)).astype(np.float32)) * torch.logspace(-2, 1, 576)
    best = kernels.linear(TYPES[name] | native.R16 | act8, kernels.repack(TYPES[name], blocks, 37, 576), x, 37)
    got = build.linear(TYPES[name] | flags | act8, build.repack(TYPES[name], blocks, 37, 576), x, 37)
    # float32 sums in another order: relative to the size of the terms summed
    dense = gguf_dense(blocks, name, 576)
    torch.testing.assert_close(got, best, rtol=0, atol=2e-6 * float((x.abs() @ dense.abs().T).max()))


needs_bf16_gemm = pytest.mark.needs_cpu("avx512f", "avx512bw", "avx512_vnni", "avx512_bf16")  # csrc/bf16_gemm.c


@needs_bf16_gemm
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("m", [1, 5, 12, 13, 40])
def test_bf16_prompt_rows_are_the_product_of_bf16_rounded_operands(matrices, name, m):
    """BF16: x and the dequantized weights rounded to bf16, multiplied and summed in float32: the float64 product
    of the rounded operands up to float32 sums; a partner mixed up in a pair or a row misplaced is off by ~1
    relative. And not the int16 path's answer (the flag really switched kernels)."""
    torch.manual_seed(m)
    x = torch.randn(m, 96) * torch.logspace(-2, 1, 96)
    r16 = kernels.repack(TYPES[name], matrices[name], 40, 96)
    got = kernels.linear(TYPES[name] | native.R16 | native.BF16, r16, x, 40)
    dense = gguf_dense(matrices[name], name, 96)
    want = x.bfloat16().double() @ dense.bfloat16().double().T
    # a weight whose float32 d q + m lies on a bf16 rounding tie may round either way: ~1e-3 of one product
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=2e-3 * want.abs().max().item())
    exact = x.double() @ dense.double().T
    assert (got.double() - exact).norm() < 1e-2 * exact.norm()
    assert not torch.equal(got, kernels.linear(TYPES[name] | native.R16, r16, x, 40))


@pytest.mark.parametrize("flag", ["ACT8", pytest.param("BF16", marks=pytest.mark.needs_cpu("avx512_bf16"))])
def test_an_int8_or_bf16_row_is_the_same_in_any_tile(r16, matrices, flag):
    """As with int16: a row's output does not depend on how many rows share the call."""
    build, flags = r16
    if flag == "BF16" and not (build.bf16_gemm and flags == native.R16):
        flags = native.R16  # bf16 products: the AVX-512 kernels' only (bf16_gemm.c)
        build = kernels
    torch.manual_seed(1)
    x = torch.randn(25, 96)
    packed = build.repack(native.Q4_1, matrices["Q4_1"], 40, 96)
    qtype = native.Q4_1 | flags | getattr(native, flag)
    whole = build.linear(qtype, packed, x, 40)
    for m in (1, 2, 3, 4, 5, 6, 7, 12, 16):
        assert torch.equal(build.linear(qtype, packed, x[:m], 40), whole[:m]), m


@pytest.mark.parametrize("act8", [0, native.ACT8], ids=["int16", "int8"])
def test_a_prompts_rows_past_an_l2_chunk_are_the_rows_of_a_small_call(r16, matrices, act8):
    """The 256-bit kernels take a long prompt's rows in chunks whose activations fit L2 (1,024 int16 rows of 96
    values, 2,048 int8 ones): every row, on either side of a chunk's edge and in the last partial chunk, is what
    a call with only its neighbours gives."""
    build, flags = r16
    torch.manual_seed(2)
    x = torch.randn(2100, 96)
    packed = build.repack(native.Q4_1, matrices["Q4_1"], 40, 96)
    qtype = native.Q4_1 | flags | act8
    whole = build.linear(qtype, packed, x, 40)
    for lo, hi in ((0, 8), (1016, 1032), (2040, 2056), (2092, 2100)):
        assert torch.equal(build.linear(qtype, packed, x[lo:hi], 40), whole[lo:hi]), (lo, hi)


@pytest.mark.parametrize("act8", [0, native.ACT8], ids=["int16", "int8"])
def test_repacked_linear_writes_only_the_columns_asked_for(r16, matrices, act8):
    """n_begin / n_end select whole 16-row groups (the split a helper thread would take); the rest is untouched,
    the 8 columns past the last row (n_end = 37: half a group's lanes masked) too."""
    build, flags = r16
    packed = build.repack(native.Q4_1, matrices["Q4_1"], 40, 96)
    x = torch.randn(2, 96)
    qtype = native.Q4_1 | flags | act8
    full = build.linear(qtype, packed, x, 40)
    y = torch.full((2, 48), 7.0)
    assert build.lib.ns_linear(qtype, packed.data_ptr(), x.data_ptr(), y.data_ptr(), 2, 96, 48, 16, 37) == 0
    assert torch.equal(y[:, 16:37], full[:, 16:37]) and (y[:, :16] == 7.0).all() and (y[:, 37:] == 7.0).all()


@pytest.mark.parametrize("kv_dtype", [torch.float32, pytest.param(torch.float16, marks=needs_f16c)])
@pytest.mark.parametrize("page_size,d,kh,h", [(4, 64, 3, 9), (16, 64, 3, 9), (32, 128, 2, 8), (16, 96, 1, 2)])
def test_paged_decode_attention_matches_sdpa_over_gathered_pages(one_thread, page_size, d, kh, h, kv_dtype):
    """Every path: head_dim 64 / 128 take AVX-512 where built (decode_attn512.c), 96 the plain loop; lengths that
    end mid-block, mid-page and on a page's end; a NaN in the unwritten slots past each length changes nothing;
    a float16 pool gives attention over its values widened to float32."""
    from nodeserve.attention.torch_ref import attend_decode, gather_kv

    torch.manual_seed(3)
    seq_lens = [1, 4, 5, 13, 16, 17, 37, 70]
    num_pages = sum(-(-n // page_size) for n in seq_lens) + 3
    kv = torch.randn(num_pages, 2, page_size, kh, d).to(kv_dtype)
    perm = torch.randperm(num_pages).tolist()
    tables = torch.zeros(len(seq_lens), -(-max(seq_lens) // page_size), dtype=torch.int64)
    for b, n in enumerate(seq_lens):
        pages = [perm.pop() for _ in range(-(-n // page_size))]
        tables[b, :len(pages)] = torch.tensor(pages)
        if n % page_size:
            kv[pages[-1], :, n % page_size:] = float("nan")
    q = torch.randn(len(seq_lens), h, d)
    got = kernels.paged_decode_attention(q, kv, tables, torch.tensor(seq_lens), 0.125)
    for b, n in enumerate(seq_lens):
        k, v = gather_kv(kv, tables[b:b + 1], n, torch.float32)
        want = attend_decode(q[b:b + 1], k, v, None, 0.125)
        torch.testing.assert_close(got[b:b + 1], want, rtol=1e-5, atol=1e-5)



def windowed_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, window: int,
                       scale: float) -> torch.Tensor:
    """Dense attention in float64 with an explicit mask: q [Lq, H, D] at positions q_pos, k/v [L, KH, D] at
    positions 0 .. L - 1; query i sees key j iff j <= i and i - j < window (0: no window). Masked keys are
    dropped, not just weighted 0, so NaN there cannot leak into the reference."""
    h, kh = q.shape[1], k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, pos in enumerate(q_pos.tolist()):
        lo = max(0, pos - window + 1) if window else 0
        ki = k[lo:pos + 1].double().repeat_interleave(h // kh, 1)  # [n, H, D]
        vi = v[lo:pos + 1].double().repeat_interleave(h // kh, 1)
        p = (torch.einsum("hd,nhd->hn", q[i].double(), ki) * scale).softmax(-1)
        out[i] = torch.einsum("hn,nhd->hd", p, vi)
    return out


@pytest.mark.parametrize("kv_dtype", [torch.float32, pytest.param(torch.float16, marks=needs_f16c)])
@pytest.mark.parametrize("page_size,d,kh,h", [(16, 64, 3, 9), (4, 128, 2, 8), (16, 96, 1, 2)])
@pytest.mark.parametrize("window", [1, 3, 16, 17, 40])
def test_paged_decode_attention_with_a_window_sees_only_it_and_reads_nothing_before(one_thread, page_size, d, kh,
                                                                                      h, kv_dtype, window):
    """Each row sees its last `window` positions: every slot before them holds NaN (freed pages get reused), and
    the rows still match the dense masked reference; rows no longer than the window see everything."""
    torch.manual_seed(window)
    seq_lens = [1, 3, 16, 17, 18, 33, 40, 41, 70]
    num_pages = sum(-(-n // page_size) for n in seq_lens) + 2
    kv = torch.full((num_pages, 2, page_size, kh, d), float("nan"))
    perm = torch.randperm(num_pages).tolist()
    tables = torch.zeros(len(seq_lens), -(-max(seq_lens) // page_size), dtype=torch.int64)
    ks, vs = [], []
    for b, n in enumerate(seq_lens):
        pages = [perm.pop() for _ in range(-(-n // page_size))]
        tables[b, :len(pages)] = torch.tensor(pages)
        k, v = torch.randn(n, kh, d), torch.randn(n, kh, d)
        pos = torch.arange(max(0, n - window), n)  # only the window is written: the rest stays NaN
        kv[tables[b, pos // page_size], 0, pos % page_size] = k[pos]
        kv[tables[b, pos // page_size], 1, pos % page_size] = v[pos]
        ks.append(k.to(kv_dtype).float())
        vs.append(v.to(kv_dtype).float())
    kv = kv.to(kv_dtype)
    q = torch.randn(len(seq_lens), h, d)
    got = kernels.paged_decode_attention(q, kv, tables, torch.tensor(seq_lens), 0.1, window)
    assert got.isfinite().all()
    for b, n in enumerate(seq_lens):
        want = windowed_reference(q[b:b + 1], ks[b], vs[b], torch.tensor([n - 1]), window, 0.1)
        torch.testing.assert_close(got[b:b + 1].double(), want, rtol=1e-5, atol=1e-5)

@pytest.mark.parametrize("march,kv_dtype", [
    ("native", torch.float32), pytest.param("native", torch.float16, marks=needs_f16c),
    pytest.param("x86-64-v3", torch.float32, marks=needs_f16c), pytest.param("x86-64-v3", torch.float16, marks=needs_f16c),
    ("x86-64-v2", torch.float32)])  # x86-64-v2 has no F16C: no float16 pools
@pytest.mark.parametrize("d,kh,h", [(64, 3, 9), (128, 2, 8), (96, 1, 2)])
@pytest.mark.parametrize("window", [0, 6])
def test_a_verify_steps_rows_read_their_pages_together_and_each_is_its_row_alone(one_thread, march, kv_dtype, d, kh,
                                                                                 h, window):
    """Rows with one page table (a verify step's rows of one sequence, positions n, n + 1, ...) are attended in
    one pass over its pages: each row's output is bit for bit the one it gets called alone, on every build (the
    AVX-512 kernel, the AVX2 loop, the plain one), with a window too; rows of other sequences around them too."""
    built = build_for(march)
    torch.manual_seed(d + window)
    page_size = 16
    kv = torch.randn(40, 2, page_size, kh, d).to(kv_dtype)
    perm = torch.randperm(40).tolist()
    seqs = [(37, 5), (18, 1), (16, 3), (33, 8), (2, 2)]  # (length after the rows, rows): a row's len is its position + 1
    rows, lens = [], []
    for n, r in seqs:
        table = [perm.pop() for _ in range(-(-n // page_size))]
        for j in range(r):
            rows.append(table)
            lens.append(n - r + 1 + j)
    tables = torch.zeros(len(rows), max(len(t) for t in rows), dtype=torch.int64)
    for b, t in enumerate(rows):
        tables[b, :len(t)] = torch.tensor(t)
    q = torch.randn(len(rows), h, d)
    got = built.paged_decode_attention(q, kv, tables, torch.tensor(lens), 0.125, window)
    for b in range(len(rows)):
        alone = built.paged_decode_attention(q[b:b + 1], kv, tables[b:b + 1], torch.tensor(lens[b:b + 1]), 0.125,
                                             window)
        assert torch.equal(got[b:b + 1], alone), (b, lens[b])


def test_pointwise_kernels_match_torch_ops(one_thread):
    from nodeserve.model.native_ops import NativeOps
    from nodeserve.model.ops import TorchOps
    from nodeserve.model.rope import RotaryEmbedding

    torch.manual_seed(4)
    rope = RotaryEmbedding(64, 10000.0, None)
    ref, nat = TorchOps(rope), NativeOps(kernels, rope, 512)
    x, res, w = torch.randn(5, 96) * 3, torch.randn(5, 96), torch.rand(96) + 0.5
    torch.testing.assert_close(nat.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5))
    want = ref.add_rms_norm(x, res, w, 1e-5)
    got = nat.add_rms_norm(x.clone(), res.clone(), w, 1e-5)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    gu = torch.randn(5, 2 * 80) * 10
    torch.testing.assert_close(nat.silu_and_mul(gu), ref.silu_and_mul(gu))
    into = torch.full((7, 80), float("nan"))  # out=: rows of a bigger buffer, as the MLP's row blocks write them
    assert nat.silu_and_mul(gu, out=into[1:6]).data_ptr() == into[1:6].data_ptr()
    assert torch.equal(into[1:6], nat.silu_and_mul(gu)) and into[0].isnan().all() and into[6].isnan().all()
    torch.testing.assert_close(ref.silu_and_mul(gu, out=torch.empty(5, 80)), ref.silu_and_mul(gu))
    with pytest.raises(ValueError, match="contiguous float32"):
        nat.silu_and_mul(gu, out=torch.empty(5, 160)[:, :80])
    qkv = torch.randn(5, (9 + 3 + 3) * 64)  # rows of the fused projection: q and k are strided views
    positions = torch.tensor([0, 1, 7, 300, 511])
    q, k = qkv[:, :576].view(5, 9, 64), qkv[:, 576:768].view(5, 3, 64)
    want_q, want_k = ref.rotary(positions, torch.float32).apply(q.clone(), k.clone())
    got_q, got_k = nat.rotary(positions, torch.float32).apply(q, k)
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)
    assert got_q.data_ptr() == q.data_ptr()  # in place


@pytest.mark.parametrize("kv_dtype", [torch.float32, pytest.param(torch.float16, marks=needs_f16c)])
def test_write_kv_scatters_like_index_put(kv_dtype):
    """float16: rounded to nearest even, as torch's conversion, bit for bit (values past 65504 become inf)."""
    from nodeserve.attention.torch_ref import write_kv

    torch.manual_seed(5)
    kv = torch.zeros(6, 2, 4, 3, 8, dtype=kv_dtype)
    qkv = torch.randn(5, 9 * 8) * torch.logspace(-6, 5, 72)  # subnormal in float16 .. past its range
    k, v = qkv[:, :24].view(5, 3, 8), qkv[:, 24:48].view(5, 3, 8)
    slots = torch.tensor([0, 5, 23, 9, 10])
    want = kv.clone()
    write_kv(want, k, v, slots)
    kernels.write_kv(kv, k, v, slots)
    assert torch.equal(kv, want)


def test_build_is_cached_per_cpu_and_source(tmp_path, monkeypatch):
    monkeypatch.setenv("NODESERVE_CACHE_DIR", str(tmp_path))
    native.load.cache_clear()
    try:
        first = native.load()
        assert first is not None and first.path.startswith(str(tmp_path))
        native.load.cache_clear()
        monkeypatch.setattr(native, "_cpu_flags", lambda: "flags : another cpu")
        built = []  # the same source again: a copy of the first build stands for the compiler's (~8 s saved)
        monkeypatch.setattr(native, "_compile", lambda cc, srcs, out: built.append(shutil.copy(first.path, out)))
        second = native.load()
        assert second.path != first.path and built == [second.path]  # another CPU model gets its own build
        native.load.cache_clear()
        assert native.load().path == second.path and len(built) == 1  # and finds it again without building
    finally:
        native.load.cache_clear()


def test_the_build_key_tells_cpus_of_one_name_apart(tmp_path):
    """Two VMs' CPUs both named "AMD EPYC" (Zen 3: AVX2 only; Zen 4: AVX-512) key different builds; only the first
    processor's lines count."""
    def cpuinfo(model: str, flags: str) -> str:
        block = (f"processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: {model}\n"
                 f"model name\t: AMD EPYC\nflags\t\t: {flags}\n\n")
        path = tmp_path / f"cpuinfo-{len(list(tmp_path.iterdir()))}"
        path.write_text(block + block.replace("processor\t: 0", "processor\t: 1").replace(flags, "other"))
        return str(path)

    zen3, zen4 = cpuinfo("1", "fpu sse avx2 fma f16c"), cpuinfo("17", "fpu sse avx2 fma f16c avx512f avx512bw")
    assert native._cpu_flags(zen3) != native._cpu_flags(zen4)
    assert "avx512f" in native._cpu_flags(zen4) and "other" not in native._cpu_flags(zen4)
    assert native._cpu_flags(cpuinfo("17", "fpu sse avx2 fma f16c")) != native._cpu_flags(zen4)  # flags alone differ


def test_no_compiler_means_no_kernels(monkeypatch, tmp_path):
    monkeypatch.setenv("NODESERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    native.load.cache_clear()
    try:
        assert native.load() is None
    finally:
        native.load.cache_clear()


def _check_split_with_a_lent_core(call, alone: torch.Tensor, built: native.NativeKernels | None = None) -> None:
    """kernels/csrc/lend.c: with a helper lent and wanted, `call` gives `alone` bit for bit and the helper runs
    halves of it; not lent, nothing is posted to it; freed, the thread ends. built: the build `call` runs (the
    helper must be its lend.c's), by default this CPU's."""
    lib = (built or kernels).lib
    cores = sorted(os.sched_getaffinity(0))
    h = lib.ns_helper_new(cores[-1])  # the helper on one core, this thread on another (when there are two)
    assert h
    os.sched_setaffinity(0, {cores[0]})
    try:
        lib.ns_helper_use(h)
        lib.ns_helper_lend(h, 1)
        lib.ns_helper_want(h, 1)
        deadline = time.monotonic() + 5  # on a quiet machine the first call; on a loaded one, once scheduled
        while lib.ns_helper_jobs(h) == 0 and time.monotonic() < deadline:
            assert torch.equal(call(), alone)
        assert lib.ns_helper_jobs(h) > 0  # it spins while lent and wanted: it takes halves
        for _ in range(20):
            assert torch.equal(call(), alone)
        lib.ns_helper_lend(h, 0)
        before = lib.ns_helper_jobs(h)
        for _ in range(10):
            assert torch.equal(call(), alone)
        assert lib.ns_helper_jobs(h) == before
    finally:
        os.sched_setaffinity(0, set(cores))
        lib.ns_helper_use(None)
        lib.ns_helper_free(h)


@pytest.mark.parametrize("name", TYPES)
def test_a_lent_core_takes_half_the_rows_and_the_result_is_the_same(name):
    torch.manual_seed(4)
    n, k = 1000, 256
    w = gguf_blocks((np.random.default_rng(4).standard_normal((n, k)) * 0.1).astype(np.float32), name)
    qtype = TYPES[name]
    if kernels.r16:
        w, qtype = kernels.repack(qtype, w, n, k), qtype | native.R16
    x = torch.randn(3, k)
    _check_split_with_a_lent_core(lambda: kernels.linear(qtype, w, x, n), kernels.linear(qtype, w, x, n))


def test_a_lent_core_takes_the_later_sequences_of_decode_attention_and_the_result_is_the_same():
    torch.manual_seed(5)
    page_size, kh, d, h = 16, 3, 64, 9
    seq_lens = [700, 3, 150, 151, 64, 1, 300, 90]  # uneven: the split is by KV tokens, not by sequences
    pages_each = [-(-n // page_size) for n in seq_lens]
    kv = torch.randn(sum(pages_each), 2, page_size, kh, d)
    perm = torch.randperm(sum(pages_each)).tolist()
    tables = torch.zeros(len(seq_lens), max(pages_each), dtype=torch.int64)
    for b, n in enumerate(pages_each):
        tables[b, :n] = torch.tensor([perm.pop() for _ in range(n)])
    q, lens = torch.randn(len(seq_lens), h, d), torch.tensor(seq_lens)
    _check_split_with_a_lent_core(lambda: kernels.paged_decode_attention(q, kv, tables, lens, 0.125),
                                  kernels.paged_decode_attention(q, kv, tables, lens, 0.125))


# The prefill attention kernels (csrc/prefill_attn.c, prefill_attn_avx2.c) this machine can run: the native build's
# (AVX-512 where the CPU has it, else AVX2), its AVX2 one called on its own (what NODESERVE_KERNELS=avx2 runs), and
# an AVX2-only CPU's build (x86-64-v3).
PREFILL_BUILDS = [pytest.param(("native", False), id="native"),
                  pytest.param(("native", True), marks=needs_f16c, id="native-avx2"),
                  pytest.param(("x86-64-v3", False), marks=needs_f16c, id="x86-64-v3")]


class _Prefill:
    """One prefill attention kernel of one build: called as NativeKernels.prefill_attention."""

    def __init__(self, built: native.NativeKernels, avx2: bool):
        self.built, self.avx2 = built, avx2
        self.bf16 = built.prefill_bf16 and not avx2  # bf16 products: the AVX-512 kernel only

    def __call__(self, *args, **kwargs) -> bool:
        return self.built.prefill_attention(*args, avx2=self.avx2, **kwargs)


@pytest.fixture(scope="module", params=PREFILL_BUILDS)
def prefill(request):
    march, avx2 = request.param
    built = build_for(march)
    if march == "x86-64-v3":  # what an AVX2-only CPU runs: the AVX2 kernel, float32 products only
        assert built.prefill and built.prefill_avx2 and built.prefill_isa == "avx2" and not built.prefill_bf16
    if not (built.prefill_avx2 if avx2 else built.prefill):
        pytest.skip(f"no prefill attention kernel in the {march} build")
    return _Prefill(built, avx2)


def _prefill_case(num_prefix: int, q_len: int, page_size: int, h: int, kh: int, d: int, seed: int = 0):
    """A sequence of num_prefix + q_len tokens on shuffled pages of a pool with spare pages of NaN (read by
    mistake, they would show), and q_len query rows strided as the fused QKV projection leaves them."""
    g = torch.Generator().manual_seed(seed)
    seq_len = num_prefix + q_len
    num_pages = -(-seq_len // page_size)
    kv = torch.full((num_pages + 3, 2, page_size, kh, d), float("nan"))
    table = torch.randperm(num_pages + 3, generator=g)[:num_pages].contiguous()
    pos = torch.arange(seq_len)
    kv[table[pos // page_size], :, pos % page_size] = torch.randn(seq_len, 2, kh, d, generator=g)
    q = torch.randn(q_len, (h + 2 * kh) * d, generator=g)[:, :h * d].view(q_len, h, d)
    return kv, table, q


def _causal_mask(num_prefix: int, q_len: int, shift: int = 0) -> torch.Tensor:
    """[1, 1, q_len, seq_len]: query i (position num_prefix + i) sees keys up to its position + shift."""
    seq_len = num_prefix + q_len
    return (torch.arange(seq_len)[None, :] <= torch.arange(num_prefix, seq_len)[:, None] + shift)[None, None]


@pytest.mark.parametrize("num_prefix,q_len,page_size,h,kh,d", [
    (0, 1, 16, 9, 3, 64), (0, 17, 16, 9, 3, 64), (3, 1, 16, 9, 3, 64), (47, 3, 16, 9, 3, 64),
    (0, 100, 3, 9, 3, 64), (37, 64, 1, 9, 3, 64), (100, 33, 64, 9, 3, 64), (300, 257, 16, 9, 3, 64),
    (5, 70, 7, 8, 2, 128), (10, 40, 16, 4, 4, 128), (9, 13, 5, 6, 1, 40)])
def test_prefill_attention_matches_masked_sdpa_over_gathered_pages(one_thread, prefill, num_prefix, q_len,
                                                                   page_size, h, kh, d):
    """Within 1e-5 of SDPA over the gathered pages, written into rows ldo apart (the rest of each row untouched);
    a kernel one key off the diagonal (query i seeing key i + 1, or not its own) would be far outside that."""
    from nodeserve.attention.torch_ref import attend, gather_kv

    kv, table, q = _prefill_case(num_prefix, q_len, page_size, h, kh, d)
    rows = torch.full((q_len, (h + 1) * d), 7.0)
    out = rows[:, :h * d].view(q_len, h, d)
    assert prefill(q, kv, table, num_prefix, d ** -0.5, out)
    assert torch.all(rows[:, h * d:] == 7.0)
    seq_len = num_prefix + q_len
    k, v = gather_kv(kv, table[None], seq_len)
    want = attend(q[None], k, v, _causal_mask(num_prefix, q_len), False, d ** -0.5)[0]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    for shift in (1, -1):  # the causal offset off by one: the comparison above would fail
        if q_len > 1 and num_prefix + shift >= 0:
            wrong = attend(q[None], k, v, _causal_mask(num_prefix, q_len, shift), False, d ** -0.5)[0]
            assert (out - wrong).abs().max() > 1e-2


@pytest.mark.parametrize("num_prefix,q_len,page_size,h,kh,d", [(0, 17, 16, 9, 3, 64), (47, 30, 7, 9, 3, 64),
                                                              (5, 70, 16, 8, 2, 128), (1536, 61, 16, 9, 3, 64)])
def test_prefill_attention_reads_float16_pools(one_thread, prefill, num_prefix, q_len, page_size, h, kh, d):
    """A float16 pool: attention over its values widened to float32 (its NaN spare pages still unread)."""
    from nodeserve.attention.torch_ref import attend, gather_kv

    kv, table, q = _prefill_case(num_prefix, q_len, page_size, h, kh, d)
    kv = kv.half()
    out = torch.full((q_len, h, d), 7.0)
    assert prefill(q, kv, table, num_prefix, d ** -0.5, out)
    seq_len = num_prefix + q_len
    k, v = gather_kv(kv, table[None], seq_len, torch.float32)
    want = attend(q[None], k, v, _causal_mask(num_prefix, q_len), False, d ** -0.5)[0]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@needs_f16c
@pytest.mark.parametrize("march", ["native", "x86-64-v3"])
def test_the_avx2_prefill_attention_refuses_bf16_products(march):
    """bf16 products need AVX512-BF16: the AVX2 kernel returns False and leaves out alone (the caller then runs
    float32)."""
    built = build_for(march)
    kv, table, q = _prefill_case(5, 9, 16, 9, 3, 64)
    out = torch.full((9, 9, 64), 7.0)
    assert not built.prefill_attention(q, kv, table, 5, 0.125, out, bf16=True, avx2=True)
    assert torch.all(out == 7.0)
    if march == "x86-64-v3":  # its plain entry point too
        assert not built.prefill_attention(q, kv, table, 5, 0.125, out, bf16=True) and torch.all(out == 7.0)
    assert built.prefill_attention(q, kv, table, 5, 0.125, out, avx2=True)


def test_a_plain_x86_64_build_has_no_prefill_attention():
    plain = build_for("x86-64-v2")
    assert not plain.prefill and not plain.prefill_avx2 and plain.prefill_isa is None
    kv, table, q = _prefill_case(5, 9, 16, 9, 3, 64)
    out = torch.full((9, 9, 64), 7.0)
    assert not plain.prefill_attention(q, kv, table, 5, 0.125, out) and torch.all(out == 7.0)


needs_bf16 = pytest.mark.needs_cpu("avx512f", "avx512_bf16")  # the prefill attention kernel's bf16 products


@needs_bf16
@pytest.mark.parametrize("num_prefix,q_len,page_size,h,kh,d", [
    (0, 1, 16, 9, 3, 64), (0, 17, 16, 9, 3, 64), (47, 30, 7, 9, 3, 64), (37, 64, 1, 9, 3, 64),
    (300, 257, 16, 9, 3, 64), (5, 70, 7, 8, 2, 128)])
def test_prefill_attention_in_bf16_stays_within_bf16_rounding_of_exact_attention(one_thread, num_prefix, q_len,
                                                                                 page_size, h, kh, d):
    """bf16 products (8-bit mantissas): within 2e-2 of attention in float64 everywhere (a pair multiplied with
    the wrong partner, or a key against the wrong query, is off by ~1), and not the float32 kernel's answer."""
    kv, table, q = _prefill_case(num_prefix, q_len, page_size, h, kh, d)
    out, exact32 = torch.full((q_len, h, d), 7.0), torch.empty(q_len, h, d)
    assert kernels.prefill_attention(q, kv, table, num_prefix, d ** -0.5, out, bf16=True)
    assert kernels.prefill_attention(q, kv, table, num_prefix, d ** -0.5, exact32)
    seq_len = num_prefix + q_len
    pos = torch.arange(seq_len)
    k, v = (kv[table[pos // page_size], i, pos % page_size].double().repeat_interleave(h // kh, 1) for i in (0, 1))
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * d ** -0.5
    scores = scores.masked_fill(pos[None, :] > torch.arange(num_prefix, seq_len)[:, None], float("-inf"))
    want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    err = (out.double() - want).abs()
    assert err.max() < 2e-2 and err.mean() < 3e-3
    if q_len > 1 or num_prefix:
        assert not torch.equal(out, exact32)



def _windowed_prefill_case(num_prefix: int, q_len: int, page_size: int, h: int, kh: int, d: int, window: int):
    """_prefill_case's sequence with NaN in every slot before the first query's window (and its spare pages)."""
    kv, table, q = _prefill_case(num_prefix, q_len, page_size, h, kh, d, seed=window)
    seq_len = num_prefix + q_len
    pos = torch.arange(seq_len)
    k, v = (kv[table[pos // page_size], i, pos % page_size].clone() for i in (0, 1))  # [L, KH, D] before the NaN
    gone = pos[:max(0, num_prefix - window + 1)]
    kv[table[gone // page_size], :, gone % page_size] = float("nan")
    return kv, table, q, k, v


@pytest.mark.parametrize("num_prefix,q_len,page_size,h,kh,d,window", [
    (0, 40, 16, 9, 3, 64, 1), (0, 40, 16, 9, 3, 64, 3), (0, 70, 16, 9, 3, 64, 16), (0, 70, 16, 9, 3, 64, 17),
    (47, 30, 16, 9, 3, 64, 3), (47, 30, 16, 9, 3, 64, 16), (47, 30, 16, 9, 3, 64, 17), (100, 33, 7, 8, 2, 128, 40),
    (300, 257, 16, 9, 3, 64, 64), (5, 70, 16, 4, 4, 128, 500), (16, 1, 16, 9, 3, 64, 16), (17, 1, 16, 9, 3, 64, 17),
    (29, 21, 5, 9, 3, 64, 9), (1, 11, 16, 9, 3, 64, 2)])
def test_prefill_attention_with_a_window_sees_only_it_and_reads_nothing_before(one_thread, prefill, num_prefix,
                                                                              q_len, page_size, h, kh, d, window):
    """Query i sees its last `window` positions; every slot before the first query's window holds NaN and changes
    nothing. float32 and float16 pools, float32 products; within bf16 rounding with bf16 products."""
    kv, table, q, k, v = _windowed_prefill_case(num_prefix, q_len, page_size, h, kh, d, window)
    want = windowed_reference(q, k, v, torch.arange(num_prefix, num_prefix + q_len), window, d ** -0.5)
    out = torch.full((q_len, h, d), 7.0)
    assert prefill(q, kv, table, num_prefix, d ** -0.5, out, window=window)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    kv16 = kv.half()
    want16 = windowed_reference(q, k.half().float(), v.half().float(), torch.arange(num_prefix, num_prefix + q_len),
                                window, d ** -0.5)
    assert prefill(q, kv16, table, num_prefix, d ** -0.5, out, window=window)
    torch.testing.assert_close(out.double(), want16, rtol=1e-5, atol=1e-5)
    if prefill.bf16:
        assert prefill(q, kv, table, num_prefix, d ** -0.5, out, bf16=True, window=window)
        err = (out.double() - want).abs()
        assert err.max() < 2e-2 and err.mean() < 3e-3

def test_a_lent_core_takes_prefill_attention_tasks_and_the_result_is_the_same(prefill):
    kv, table, q = _prefill_case(200, 300, 16, 9, 3, 64, seed=6)

    for bf16 in (False, True) if prefill.bf16 else (False,):
        def call():
            out = torch.empty(300, 9, 64)
            assert prefill(q, kv, table, 200, 0.125, out, bf16)
            return out
        _check_split_with_a_lent_core(call, call(), prefill.built)


# ---------- ns_decode_layer split over a tensor-parallel group (csrc/allreduce.c) ----------

H, NH, KH, D, I = 64, 4, 2, 32, 128  # two ranks: 2 query heads, 1 KV head and 64 intermediate columns each
PAGE, SEQ_LENS = 4, [5, 9]  # two rows, each decoding its last position


def _random_layer():
    """A Q8_0 layer's fused weights (GGUF blocks) and float32 norms and qkv bias, and a step's inputs."""
    rng = np.random.default_rng(6)

    def blocks(n, k):
        return gguf_blocks((rng.standard_normal((n, k)) * 0.2).astype(np.float32), "Q8_0")

    w = {"qkv": blocks((NH + 2 * KH) * D, H), "o": blocks(H, NH * D), "gate_up": blocks(2 * I, H),
         "down": blocks(H, I)}
    w["bias"] = torch.from_numpy(rng.standard_normal((NH + 2 * KH) * D).astype(np.float32))
    w["input_norm"], w["post_norm"] = (torch.from_numpy(rng.uniform(0.5, 1.5, H).astype(np.float32))
                                       for _ in range(2))
    inv = 1.0 / 10000 ** (torch.arange(0, D, 2) / D)
    angles = torch.arange(64)[:, None] * inv[None]
    cos_sin = torch.cat([angles.cos(), angles.sin()], -1).contiguous()  # [positions, D]: cos | sin halves
    pages = [-(-n // PAGE) for n in SEQ_LENS]
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]])[:, :max(pages)].contiguous()
    kv = torch.from_numpy(rng.standard_normal((6, 2, PAGE, KH, D)).astype(np.float32))  # the cached history
    x = torch.from_numpy(rng.standard_normal((len(SEQ_LENS), H)).astype(np.float32))
    positions = torch.tensor([n - 1 for n in SEQ_LENS])
    slots = torch.tensor([int(tables[b, p // PAGE]) * PAGE + p % PAGE for b, p in enumerate(positions.tolist())])
    return w, dict(cos_sin=cos_sin, tables=tables, kv=kv, x=x, positions=positions, slots=slots)


def _shard(w, rank: int, num_ranks: int):
    """Rank's Megatron shard: its query and KV heads' rows of qkv (and bias), its gate and up rows, and the
    matching input columns of o and down (whole Q8_0 blocks: 34 bytes a 32 columns)."""
    if num_ranks == 1:
        return w
    nh, kh, i = NH // num_ranks, KH // num_ranks, I // num_ranks
    rows = torch.cat([torch.arange(rank * nh * D, (rank + 1) * nh * D),
                      NH * D + torch.arange(rank * kh * D, (rank + 1) * kh * D),
                      (NH + KH) * D + torch.arange(rank * kh * D, (rank + 1) * kh * D)])
    gate_up = torch.cat([torch.arange(rank * i, (rank + 1) * i), I + torch.arange(rank * i, (rank + 1) * i)])

    def columns(m, width):
        return m[:, rank * width // 32 * 34:(rank + 1) * width // 32 * 34].contiguous()

    return dict(w, qkv=w["qkv"][rows].contiguous(), bias=w["bias"][rows].contiguous(),
                o=columns(w["o"], nh * D), gate_up=w["gate_up"][gate_up].contiguous(), down=columns(w["down"], i))


def _decode_layer(w, s, x, kv, group=None, rank=0, num_ranks=1) -> int:
    import ctypes

    from nodeserve.model.native_decoder import _Layer, _Step

    q8 = native.Q8_0
    layer = _Layer(H, NH // num_ranks, KH // num_ranks, D, I // num_ranks, 1e-5, w["input_norm"].data_ptr(),
                   w["post_norm"].data_ptr(), w["bias"].data_ptr(), w["qkv"].data_ptr(), w["o"].data_ptr(),
                   w["gate_up"].data_ptr(), w["down"].data_ptr(), q8, q8, q8, q8)
    seq_lens = torch.tensor(SEQ_LENS)
    step = _Step(x.shape[0], s["tables"].shape[1], PAGE, s["positions"].data_ptr(), s["slots"].data_ptr(),
                 s["tables"].data_ptr(), seq_lens.data_ptr(), s["cos_sin"].data_ptr(), D ** -0.5, 0, group, rank)
    fn = kernels.lib.ns_decode_layer
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p] * 4  # as NativeDecoder sets them
    return fn(ctypes.byref(layer), ctypes.byref(step), x.data_ptr(), kv.data_ptr())


def _on_rank_threads(num_ranks: int, body) -> list:
    import threading

    out: list = [None] * num_ranks
    threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, body(r))) for r in range(num_ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    return out


def test_a_decode_layer_in_a_group_of_one_is_the_layer_alone(one_thread):
    from nodeserve.device.collectives import CPUAllReduce

    w, s = _random_layer()
    group = CPUAllReduce(1, kernels)
    outs = []
    for handle in (None, group.handle):
        x, kv = s["x"].clone(), s["kv"].clone()
        assert _decode_layer(w, s, x, kv, handle) == 0
        outs.append((x, kv))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert not torch.equal(outs[0][0], s["x"])  # the layer ran


def test_a_decode_layer_split_over_two_ranks_is_the_whole_layer(one_thread):
    """Megatron's split: each rank's attention over its heads and MLP over its columns, the o and down outputs
    all-reduced inside the call; the residual stream equals the unsplit layer's to float rounding, the same bits
    on both ranks, and each rank's pool holds its KV head of the whole layer's."""
    from nodeserve.device.collectives import CPUAllReduce

    w, s = _random_layer()
    x, kv = s["x"].clone(), s["kv"].clone()
    assert _decode_layer(w, s, x, kv) == 0
    group = CPUAllReduce(2, kernels)
    xs = [s["x"].clone() for _ in range(2)]
    kvs = [s["kv"][:, :, :, r:r + 1].contiguous() for r in range(2)]
    rcs = _on_rank_threads(2, lambda r: _decode_layer(_shard(w, r, 2), s, xs[r], kvs[r], group.handle, r, 2))
    assert rcs == [0, 0]
    assert torch.equal(xs[0], xs[1])
    torch.testing.assert_close(xs[0], x, rtol=1e-5, atol=1e-5)
    for r in range(2):
        torch.testing.assert_close(kvs[r], kv[:, :, :, r:r + 1], rtol=1e-6, atol=1e-6)


def test_a_decode_layer_whose_peer_never_comes_fails_once_the_group_is_aborted(one_thread):
    import threading

    from nodeserve.device.collectives import CPUAllReduce

    w, s = _random_layer()
    group = CPUAllReduce(2, kernels)
    aborter = threading.Timer(0.2, group.abort)
    aborter.start()
    started = time.monotonic()
    rcs = _on_rank_threads(1, lambda r: _decode_layer(_shard(w, 0, 2), s, s["x"].clone(),
                                                      s["kv"][:, :, :, :1].contiguous(), group.handle, 0, 2))
    aborter.join()
    assert rcs == [-1] and time.monotonic() - started < 1.2


# ---- Q5_1 and the K-quants (csrc/kquant.c), in every build the dispatch can pick ----

KQ_TYPES = {"Q5_1": native.Q5_1, "Q4_K": native.Q4_K, "Q5_K": native.Q5_K, "Q6_K": native.Q6_K}
KQ_F16_FIELDS = {"Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # byte offsets in a block
# the kernels for this CPU; an AVX-512 CPU without VNNI's (x86-64-v4); an AVX2-only machine's (x86-64-v3: AVX2,
# FMA, F16C); a plain x86-64 CPU's, the scalar C (x86-64-v2)
BUILDS = ["native", pytest.param("x86-64-v4", marks=needs_v4), pytest.param("x86-64-v3", marks=needs_f16c),
          "x86-64-v2"]


@pytest.fixture(scope="module", params=BUILDS)
def kq_build(request):
    """The kernels built for one -march (NODESERVE_KERNELS_MARCH), cached on disk like any build."""
    return build_for(request.param)


def kq_blocks(name: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """n rows of K weights in `name`'s blocks: random bytes (any quants, packed scales and high bits are valid)
    with finite fp16 scales of either sign, and row 3's scales zero."""
    block, size = native.BLOCK_LAYOUTS[KQ_TYPES[name]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for off in KQ_F16_FIELDS[name]:
        scale = (rng.uniform(0.001, 0.05, raw.shape[:2]) * rng.choice([-1, 1], raw.shape[:2])).astype(np.float16)
        raw[..., off:off + 2] = scale[..., None].view(np.uint8)
        raw[3, :, off:off + 2] = 0
    return torch.from_numpy(raw.reshape(n, -1).copy())


@pytest.mark.parametrize("name", KQ_TYPES)
def test_kquant_dequantize_is_bit_exact_with_gguf(kq_build, name):
    blocks = kq_blocks(name, 40, 512)
    want = gguf_dense(blocks, name, 512)
    got = kq_build.dequantize(KQ_TYPES[name], blocks, 512)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # bit for bit, signed zeros too
    rows = torch.tensor([5, 0, 39, 5])
    assert torch.equal(kq_build.dequantize(KQ_TYPES[name], blocks, 512, rows), want[rows])


def test_q5_1_from_gguf_quantizer_dequantizes_exactly(kq_build):
    w = np.random.default_rng(2).standard_normal((8, 64)).astype(np.float32)
    blocks = gguf_blocks(w, "Q5_1")
    assert torch.equal(kq_build.dequantize(native.Q5_1, blocks, 64), gguf_dense(blocks, "Q5_1", 64))


@pytest.mark.parametrize("name", KQ_TYPES)
@pytest.mark.parametrize("m", [2, 3, 5, 17, 33])
def test_kquant_linear_is_float32_math_on_the_blocks_weights(kq_build, name, m):
    blocks, k = kq_blocks(name, 40, 512, seed=m), 512
    torch.manual_seed(m)
    x = torch.randn(m, k)
    dense = gguf_dense(blocks, name, k)
    want = x @ dense.T
    got = kq_build.linear(KQ_TYPES[name], blocks, x, 40)
    # float32 sums in another order: relative to the size of the terms summed
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6 * float((x.abs() @ dense.abs().T).max()))


@pytest.mark.parametrize("name", KQ_TYPES)
def test_kquant_one_row_rounds_activations_to_int16_per_block(kq_build, name):
    """Batch-1 decode with AVX2: activations rounded to 15 bits per block of 32, as for Q4_0/Q4_1/Q8_0 (the scalar
    build computes in float32, within the same bound)."""
    blocks, k = kq_blocks(name, 40, 512, seed=7), 512
    torch.manual_seed(1)
    x = torch.randn(1, k) * torch.logspace(-2, 1, k)  # blocks of very different scales
    dense = gguf_dense(blocks, name, k)
    want = x @ dense.T
    got = kq_build.linear(KQ_TYPES[name], blocks, x, 40)
    xb = x.view(1, k // 32, 32).abs().amax(-1)  # [1, blocks]
    sq = rounded_part(blocks, name, k).abs()  # [40, k]
    bound = (sq.view(40, k // 32, 32).sum(-1) * xb / 32767 / 2).sum(-1)  # [40]
    slack = 2e-6 * (x.abs() @ dense.abs().T)[0]  # the float32 sums
    assert ((got - want).abs()[0] <= bound + slack).all()
    assert torch.equal(got[0, 3], torch.tensor(0.0))  # zero scales: zero weights


@pytest.mark.parametrize("name", KQ_TYPES)
def test_kquant_linear_writes_only_its_columns(name):
    """ns_linear over columns [n_begin, n_end) of a wider y (how lend.c splits a GEMM and how the decode layer
    writes): the rest of y is left alone."""
    blocks, k = kq_blocks(name, 24, 256, seed=3), 256
    x = torch.randn(2, k)
    y = torch.full((2, 24), 7.0)
    assert kernels.lib.ns_linear(KQ_TYPES[name], blocks.data_ptr(), x.data_ptr(), y.data_ptr(), 2, k, 24, 5,
                                 11) == 0
    want = x @ gguf_dense(blocks, name, k).T
    torch.testing.assert_close(y[:, 5:11], want[:, 5:11], rtol=1e-5, atol=1e-4)
    assert (y[:, :5] == 7).all() and (y[:, 11:] == 7).all()


def test_a_decode_layer_takes_its_window_and_reads_nothing_before_it(one_thread):
    """ns_decode_layer with the layer's window 5 at lengths 5 and 9 (page size 4): the second row's first page lies
    wholly before its window and holds NaN; the layer equals the unwindowed one over the same row with that page
    dropped from its table (the positions, and so RoPE, unchanged)."""
    import ctypes

    from nodeserve.model.native_decoder import _Layer, _Step

    w, s = _random_layer()
    q8 = native.Q8_0

    def run(tables: torch.Tensor, seq_lens: list[int], window: int, kv: torch.Tensor) -> torch.Tensor:
        layer = _Layer(H, NH, KH, D, I, 1e-5, w["input_norm"].data_ptr(), w["post_norm"].data_ptr(),
                       w["bias"].data_ptr(), w["qkv"].data_ptr(), w["o"].data_ptr(), w["gate_up"].data_ptr(),
                       w["down"].data_ptr(), q8, q8, q8, q8, window)
        lens, x = torch.tensor(seq_lens), s["x"].clone()
        step = _Step(x.shape[0], tables.shape[1], PAGE, s["positions"].data_ptr(), s["slots"].data_ptr(),
                     tables.data_ptr(), lens.data_ptr(), s["cos_sin"].data_ptr(), D ** -0.5, 0, None, 0)
        fn = kernels.lib.ns_decode_layer
        fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p] * 4
        assert fn(ctypes.byref(layer), ctypes.byref(step), x.data_ptr(), kv.data_ptr()) == 0
        return x

    kv = s["kv"].clone()
    kv[3] = float("nan")  # row 1's page of positions 0 .. 3, before its window 4 .. 8
    windowed = run(s["tables"], SEQ_LENS, 5, kv)
    shifted = torch.tensor([[0, 1, 2], [4, 5, 5]])  # row 1 from its second page: 5 tokens, at the same slots
    want = run(shifted, [5, 5], 0, s["kv"].clone())
    assert windowed.isfinite().all()
    torch.testing.assert_close(windowed, want, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(windowed, run(s["tables"], SEQ_LENS, 0, s["kv"].clone()))  # the window mattered
