"""TorchAttention over a paged KV pool equals plain dense causal attention, sequence by sequence."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from nodeserve.attention.base import AttentionMetadata
from nodeserve.attention.torch_ref import TorchAttention, gather_kv, write_kv
from nodeserve.kernels import native
from nodeserve.kv.pool import KVPool
from nodeserve.runtime.model_runner import ModelRunner

H, KH, D = 8, 2, 32
SCALE = D ** -0.5  # what the backend derives from head_dim
CFG = SimpleNamespace(num_layers=1, num_heads=H, num_kv_heads=KH, head_dim=D, softmax_scale=SCALE,
                      window=lambda layer: 0)
ATOL = 1e-5

# (cached tokens, new tokens) per sequence. q_len 1 is a decode; the rest are prefill chunks.
DECODES = [(0, 1), (4, 1), (15, 1), (16, 1), (63, 1), (64, 1), (99, 1)]
PREFILLS = [(0, 7), (0, 64), (20, 13), (3, 64), (63, 2), (1, 2), (100, 37)]


pytestmark = pytest.mark.usefixtures("one_thread")


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0) -> torch.Tensor:
    """q [Lq, H, D], k/v [L, KH, D] (the whole sequence); query i sits at position L - Lq + i and sees key j iff
    j <= i and (a window) i - j < window. float64."""
    q, k, v = q.double(), k.double(), v.double()
    lq, length = q.shape[0], k.shape[0]
    k = k.repeat_interleave(H // KH, dim=1)  # [L, H, D]
    v = v.repeat_interleave(H // KH, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * SCALE  # [H, Lq, L]
    q_pos = torch.arange(length - lq, length)[:, None]
    k_pos = torch.arange(length)[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    if window:
        scores = scores.masked_fill(q_pos - k_pos >= window, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)  # [Lq, H, D]


def _run(seqs: list[tuple[int, int]], page_size: int, seed: int, windows: tuple[int, ...] = (0,)):
    """Builds a pool holding each sequence's cached prefix on shuffled pages, runs one step, checks it. One layer
    per window: a windowed layer's slots before each sequence's first query's window hold NaN (freed pages may be
    reused and hold anything), and must change nothing."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    seqs = sorted(seqs, key=lambda s: s[1] != 1)  # the backend's contract: decodes first
    pages_needed = [-(-(c + n) // page_size) for c, n in seqs]
    num_pages = sum(pages_needed) + 5
    cfg = SimpleNamespace(**{**vars(CFG), "num_layers": len(windows), "window": windows.__getitem__})
    pool = KVPool(cfg, num_pages, page_size, torch.float32, torch.device("cpu"))
    # Garbage everywhere: a read past a sequence's length, or from a page it doesn't own, would show.
    garbage = torch.randn(num_pages, 2, page_size, KH, D, generator=gen) * 100
    for kv_layer in pool.layers:
        kv_layer.copy_(garbage)
    ids = list(range(num_pages))
    rng.shuffle(ids)
    tables, full_k, full_v, qs, new_k, new_v, slots = [], [], [], [], [], [], []
    for (cached, new), n_pages in zip(seqs, pages_needed):
        table, ids = ids[:n_pages], ids[n_pages:]
        tables.append(table)
        length = cached + new
        k = torch.randn(length, KH, D, generator=gen)
        v = torch.randn(length, KH, D, generator=gen)
        full_k.append(k)
        full_v.append(v)
        qs.append(torch.randn(new, H, D, generator=gen))
        seq_slots = [table[p // page_size] * page_size + p % page_size for p in range(length)]
        # The cached prefix is already in the pool; a windowed layer's slots before the first query's window: NaN.
        for kv_layer, window in zip(pool.layers, windows):
            for p in range(cached):
                page, off = divmod(seq_slots[p], page_size)
                gone = window and p <= cached - window
                kv_layer[page, 0, off], kv_layer[page, 1, off] = (float("nan"), float("nan")) if gone else (k[p], v[p])
        new_k.append(k[cached:])
        new_v.append(v[cached:])
        slots.extend(seq_slots[cached:])
    max_pages = max(len(t) for t in tables)
    page_tables = torch.zeros(len(seqs), max_pages, dtype=torch.int64)
    for b, t in enumerate(tables):
        page_tables[b, :len(t)] = torch.tensor(t)
    seq_lens = [c + n for c, n in seqs]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        page_tables=page_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        query_lens=[n for _, n in seqs],
        seq_lens_host=seq_lens,
        num_decodes=sum(1 for _, n in seqs if n == 1),
        page_size=page_size,
    )
    untouched = sorted(set(range(num_pages)) - {p for t in tables for p in t})
    q = torch.cat(qs)
    backend = TorchAttention(pool, cfg, torch.float32)
    backend.prepare(meta)
    for layer, (kv_layer, window) in enumerate(zip(pool.layers, windows)):
        out = backend.forward(layer, q, torch.cat(new_k), torch.cat(new_v))
        assert out.shape == q.shape and out.dtype == torch.float32
        start = 0
        for b, (cached, new) in enumerate(seqs):
            expected = _dense(qs[b], full_k[b], full_v[b], window)
            torch.testing.assert_close(out[start:start + new].double(), expected, atol=ATOL, rtol=0,
                                       msg=lambda m: f"layer {layer} (window {window}) seq {b} (cached={cached}, "
                                                     f"new={new}): {m}")
            start += new
            # This step's K/V landed in the pool: the sequence reads back from its pages (after any NaN).
            lo = max(0, cached - window + 1) if window else 0
            k_back, v_back = gather_kv(kv_layer, page_tables[b:b + 1, :pages_needed[b]], cached + new)
            torch.testing.assert_close(k_back[0, lo:], full_k[b][lo:], atol=0, rtol=0)
            torch.testing.assert_close(v_back[0, lo:], full_v[b][lo:], atol=0, rtol=0)
        assert torch.equal(kv_layer[untouched], garbage[untouched]), "wrote to pages no sequence owns"


@pytest.mark.parametrize("page_size", [1, 3, 16, 64])
def test_ragged_mixed_batch(page_size):
    _run(DECODES + PREFILLS, page_size, seed=page_size)


@pytest.mark.parametrize("page_size", [1, 3, 16, 64])
def test_decodes_only(page_size):
    _run(DECODES, page_size, seed=100 + page_size)


@pytest.mark.parametrize("page_size", [1, 3, 16, 64])
def test_prefills_only(page_size):
    _run(PREFILLS, page_size, seed=200 + page_size)


@pytest.mark.parametrize("page_size", [3, 16])
def test_single_sequence_cases(page_size):
    _run([(0, 1)], page_size, seed=1)           # the very first token
    _run([(0, 50)], page_size, seed=2)          # a whole prompt, no cache
    _run([(47, 3)], page_size, seed=3)          # a chunk after a cached prefix
    _run([(page_size, 1)], page_size, seed=4)   # a decode opening a fresh page


@pytest.mark.parametrize("page_size", [1, 3, 16, 64])
def test_random_batches(page_size):
    rng = random.Random(page_size)
    for trial in range(3):
        seqs = [(rng.randint(0, 130), 1 if rng.random() < 0.5 else rng.randint(2, 70))
                for _ in range(rng.randint(1, 9))]
        _run(seqs, page_size, seed=1000 * page_size + trial)


WINDOWS = (3, 16, 0, 17)  # page_size 16: inside a page, a page exactly, global, one past a page


@pytest.fixture(params=["native", "torch"])
def attention_path(request, monkeypatch):
    """The native kernels where built, or the PyTorch path (what a GPU or a build without them runs)."""
    if request.param == "torch":
        monkeypatch.setattr(native, "load", lambda: None)
    elif native.load() is None:
        pytest.skip("the native kernels could not be built")
    return request.param


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_windowed_layers_see_only_their_window_and_never_the_slots_before(attention_path, page_size):
    """Layers of windows 3, 16, none and 17 in one step: decodes, whole prompts and chunks after a prefix each equal
    dense attention with the window in its mask, with NaN in every slot before each sequence's first query's
    window; the global layer next to them is unchanged."""
    seqs = DECODES + PREFILLS + [(40, 1), (33, 1), (17, 1), (50, 20), (16, 17)]
    _run(seqs, page_size, seed=300 + page_size, windows=WINDOWS)


@pytest.mark.parametrize("page_size", [3, 16])
def test_windowed_decodes_and_prefills_alone(attention_path, page_size):
    _run(DECODES + [(40, 1), (170, 1)], page_size, seed=400 + page_size, windows=WINDOWS)
    _run(PREFILLS + [(50, 20)], page_size, seed=500 + page_size, windows=WINDOWS)


def test_a_window_no_row_outgrows_changes_nothing(attention_path):
    """A window longer than every sequence takes the global path: the same bytes as no window at all."""
    torch.manual_seed(9)
    outs = []
    for window in (0, 1000):
        cfg = SimpleNamespace(**{**vars(CFG), "window": lambda layer, w=window: w})
        pool = KVPool(cfg, 32, 16, torch.float32, torch.device("cpu"))
        pool.layers[0].copy_(torch.randn(32, 2, 16, KH, D, generator=torch.Generator().manual_seed(1)))
        seq_lens, query_lens = [40, 99, 37, 90], [1, 1, 37, 20]
        tables = torch.arange(32).view(4, 8)
        slots = [int(tables[b, p // 16]) * 16 + p % 16 for b, (n, ql) in enumerate(zip(seq_lens, query_lens))
                 for p in range(n - ql, n)]
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots), page_tables=tables,
                                 seq_lens=torch.tensor(seq_lens), query_lens=query_lens, seq_lens_host=seq_lens,
                                 num_decodes=2, page_size=16)
        gen = torch.Generator().manual_seed(2)
        q, k, v = (torch.randn(len(slots), n, D, generator=gen) for n in (H, KH, KH))
        backend = TorchAttention(pool, cfg, torch.float32)
        backend.prepare(meta)
        outs.append(backend.forward(0, q, k, v))
    assert torch.equal(outs[0], outs[1])

def test_write_kv_scatters_to_slots():
    page_size = 4
    kv_layer = torch.zeros(6, 2, page_size, KH, D)
    k = torch.randn(3, KH, D)
    v = torch.randn(3, KH, D)
    slots = torch.tensor([5 * page_size + 3, 0, 2 * page_size + 1])
    write_kv(kv_layer, k, v, slots)
    for i, (page, off) in enumerate([(5, 3), (0, 0), (2, 1)]):
        assert torch.equal(kv_layer[page, 0, off], k[i])
        assert torch.equal(kv_layer[page, 1, off], v[i])
    assert int((kv_layer != 0).any(-1).any(-1).sum()) == 6  # 3 K rows + 3 V rows, nothing else


def test_a_chunk_after_a_prefix_equals_one_masked_sdpa_call():
    """attend_after_prefix (the CPU path where the native prefill kernel is not built): two flash calls merged by
    their log-sum-exps give the masked call's output."""
    from nodeserve.attention.torch_ref import attend, attend_after_prefix

    torch.manual_seed(8)
    for num_prefix, q_len, h, kh in [(1, 1, 9, 3), (40, 7, 9, 3), (300, 129, 4, 4), (64, 64, 8, 2)]:
        q = torch.randn(1, q_len, h, 64)
        k, v = torch.randn(1, num_prefix + q_len, kh, 64), torch.randn(1, num_prefix + q_len, kh, 64)
        seq_len = num_prefix + q_len
        mask = (torch.arange(seq_len)[None, :] <= torch.arange(num_prefix, seq_len)[:, None])[None, None]
        torch.testing.assert_close(attend_after_prefix(q, k, v, 0.125), attend(q, k, v, mask, False, 0.125),
                                   rtol=1e-5, atol=1e-5)


# bf16 products in prompt attention (model.prompt_attention = "bfloat16") vs float32 on SmolLM2-135M (the GGUF's
# weights in float32), teacher-forced over FP8Check.TEXTS, measured on the AMD EPYC (Zen 5): 100.0 % top-1
# agreement, max |logit diff| 0.29 (float16 KV: 0.019; FP8: 96.7 %, 3.30). The bounds leave room for other CPUs.
MIN_BF16_TOP1_AGREEMENT, MAX_BF16_LOGIT_DIFF = 0.99, 0.6


@pytest.mark.skipif(native.load() is None, reason="the native kernels could not be built")
@pytest.mark.needs_cpu("avx512f", "avx512_bf16")  # the prefill attention kernel's bf16 products
@pytest.mark.skipif(native.avx2_only(), reason="NODESERVE_KERNELS=avx2: the AVX2 prefill kernel has no bf16 products")
def test_prompt_attention_in_bf16_stays_close_to_float32(fp8_check, loaded_fp32, one_thread):
    """Every teacher-forced position's logits with prompt attention's products in bf16 against float32 products:
    top-1 nearly everywhere the same, logits close; and not identical (the bf16 products really ran)."""
    def logits(prompt_attention: str) -> torch.Tensor:
        pool = KVPool(loaded_fp32.config, 64, 16, torch.float32, torch.device("cpu"))
        backend = TorchAttention(pool, loaded_fp32.config, torch.float32, prompt_attention)
        return fp8_check.teacher_forced_logits(ModelRunner(loaded_fp32.model, backend), loaded_fp32.tokenizer)

    want, got = logits("float32"), logits("bfloat16")
    agreement = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    max_diff = (got - want).abs().max().item()
    assert want.shape[0] >= 200
    assert agreement >= MIN_BF16_TOP1_AGREEMENT and max_diff <= MAX_BF16_LOGIT_DIFF, (agreement, max_diff)
    assert max_diff > 0


def test_the_prompt_kernel_it_reports_follows_the_setting_and_the_cpu():
    """What the start-up log says prompts take: float32 asks for no bf16; auto and bfloat16 get bf16 exactly where
    the kernel has it."""
    pool = KVPool(CFG, 4, 16, torch.float32, torch.device("cpu"))
    kernels = native.load()
    avx2 = native.avx2_only()  # NODESERVE_KERNELS=avx2: the AVX2 kernel, in any build that has it
    native_prefill = kernels is not None and (kernels.prefill_avx2 if avx2 else kernels.prefill)
    isa = "avx2" if avx2 else kernels.prefill_isa if native_prefill else None
    has_bf16 = native_prefill and not avx2 and kernels.prefill_bf16
    assert TorchAttention(pool, CFG, torch.float32, "float32").prompt_kernel == \
        (f"native {isa}, float32" if native_prefill else "torch")
    for setting in ("auto", "bfloat16"):
        assert TorchAttention(pool, CFG, torch.float32, setting).prompt_kernel == \
            (f"native {isa}, bf16 products" if has_bf16 else f"native {isa}, float32" if native_prefill else "torch")
    assert TorchAttention(pool, CFG, torch.bfloat16, "auto").prompt_kernel == "torch"  # not a float32 model
