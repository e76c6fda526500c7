"""Window pages (kv/window.py): what a request holds as it slides, its promise, and the pool split."""

from __future__ import annotations

import pytest
import torch

from nodeserve.kv.manager import KVManager
from nodeserve.kv.pool import KVPool
from nodeserve.kv.reservation import reserve_move, reserve_prompt, scratch_windows
from nodeserve.kv.window import WindowKV, first_window_page, max_window_pages, split_pages
from nodeserve.model.config import ModelConfig

PAGE = 16


def _window_kv(num_pages: int = 200, window: int = 512, max_chunk: int = 256) -> WindowKV:
    return WindowKV(KVManager(num_pages, PAGE), window, max_chunk)


@pytest.mark.parametrize("window", [20, 512, 1024])
@pytest.mark.parametrize("chunk", [1, 48, 256])
def test_a_sliding_request_holds_its_window_and_one_chunk_at_most(window, chunk):
    kv = _window_kv(num_pages=400, window=window, max_chunk=chunk)
    w = kv.reserve(3000, prefills=True)
    most = max_window_pages(window, PAGE, chunk)
    assert w is not None and w.max_pages == most == kv.manager.num_promised
    pos = 0
    while pos < 3000:
        n = min(chunk, 3000 - pos)
        w.advance(pos, pos + n)
        held = [b for b in w.table if b >= 0]
        first = first_window_page(pos, window, PAGE)
        # every page the step's queries read or write is held, nothing before the first query's window is
        assert all(w.table[p] >= 0 for p in range(first, -(-(pos + n) // PAGE)))
        assert all(b < 0 for b in w.table[:first])
        assert len(held) == len(set(held)) == w.num_held == kv.manager.num_used <= most
        assert w.num_held + w.num_promised == most == kv.manager.num_used + kv.manager.num_promised
        pos += n
    w.release()
    w.release()  # once only
    assert kv.manager.num_used == kv.manager.num_promised == 0


def test_decoding_on_after_a_prefill_keeps_a_window_and_one_token():
    kv = _window_kv(window=64, max_chunk=128)
    w = kv.reserve(1000, prefills=True)
    for start in range(0, 512, 128):
        w.advance(start, start + 128)
    w.shrink(1000)
    decode_most = max_window_pages(64, PAGE, 1)
    assert w.max_pages == decode_most and w.num_promised == 0 and w.num_held > decode_most  # the last chunk's
    for pos in range(512, 600):
        w.advance(pos, pos + 1)
        assert w.num_held + w.num_promised <= decode_most
        assert kv.manager.num_used + kv.manager.num_promised == w.num_held + w.num_promised
    w.release()
    assert kv.manager.num_used == kv.manager.num_promised == 0


def test_promises_count_against_every_new_claim():
    kv = _window_kv(num_pages=70, window=512)
    first = kv.reserve(8192, prefills=False)
    assert first is not None and first.max_pages == 33
    second = kv.reserve(8192, prefills=False)
    assert second is not None
    assert kv.reserve(8192, prefills=False) is None  # 66 of 70 promised: a third does not fit
    assert kv.reserve(40, prefills=False) is not None  # a short request needs its own pages only (3)
    assert not kv.manager.can_allocate(5)


def test_a_chunk_longer_than_the_promise_is_refused_not_overdrawn():
    kv = _window_kv(window=32, max_chunk=16)
    w = kv.reserve(500, prefills=True)
    with pytest.raises(RuntimeError, match="promised"):
        w.advance(0, 200)
    w.release()
    assert kv.manager.num_used == kv.manager.num_promised == 0


def test_a_reservation_short_of_window_pages_takes_nothing():
    decode, prefill = KVManager(100, PAGE), KVManager(100, PAGE)
    decode_window, prefill_window = _window_kv(num_pages=40), _window_kv(num_pages=5)
    hashes: list[bytes] = []
    assert reserve_prompt(decode, prefill, hashes, 600, 700, decode_window, prefill_window) is None
    for m in (decode, prefill, decode_window.manager, prefill_window.manager):
        assert m.num_used == 0 and m.num_promised == 0
    r = reserve_prompt(decode, prefill, hashes, 600, 700, decode_window, _window_kv(num_pages=100))
    assert r is not None and r.window is not None
    # the decode side holds the prompt's last window already: the handoff copies into it
    live = r.window.live_pages(600)
    assert all(r.window.table[p] >= 0 for p in live) and r.window.num_held == len(live)
    r.release()
    assert decode.num_used == decode_window.manager.num_used == decode_window.manager.num_promised == 0


def test_scratch_windows_give_everything_back():
    kv = _window_kv()
    with scratch_windows(kv, [(0, 16), (700, 701)]) as tables:
        assert all(t is not None for t in tables)
        assert kv.manager.num_used > 0
    assert kv.manager.num_used == kv.manager.num_promised == 0
    with scratch_windows(None, [(0, 4)]) as tables:
        assert tables == [None]


def _gemma3_270m() -> ModelConfig:
    """Gemma 3 270M's layout as its GGUF gives it: 18 layers, every 6th global, the others a window of 512."""
    windows = tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(18))
    return ModelConfig("gemma3", vocab_size=262144, hidden_size=640, intermediate_size=2048, num_layers=18,
                       num_heads=4, num_kv_heads=1, head_dim=256, rms_norm_eps=1e-6, rope_theta=1e6,
                       max_position_embeddings=32768, tie_word_embeddings=True, layer_windows=windows)


def test_gemma3_at_8k_holds_the_global_layers_context_and_the_local_layers_window():
    """The issue's target: KV pages held per request at 8k context <= (global layers' full context + local
    layers' window) / (all layers' full context), within a page per layer."""
    cfg = _gemma3_270m()
    num_windowed = sum(1 for i in range(18) if cfg.window(i))
    context, window = 8192, 512
    kv = _window_kv(num_pages=400, window=window, max_chunk=1024)
    w = kv.reserve(context + 1, prefills=True)
    for start in range(0, context, 1024):  # prefilled here, then decoding to 8k + 1
        w.advance(start, start + 1024)
    w.shrink(context + 1)
    w.advance(context, context + 1)
    held = (18 - num_windowed) * -(-(context + 1) // PAGE) + num_windowed * w.num_held  # layer-pages
    full = 18 * -(-(context + 1) // PAGE)
    bound = ((18 - num_windowed) * context + num_windowed * window) / (18 * context)
    assert held / full <= bound + 18 / full  # within a page per layer
    assert w.num_held <= window // PAGE + 1


def test_a_pool_keeps_windowed_layers_in_window_pages():
    cfg = _gemma3_270m()
    pool = KVPool(cfg, 10, PAGE, torch.float32, torch.device("cpu"), num_window_pages=4, max_chunk=64)
    assert pool.window is not None and pool.window_layers == frozenset(i for i in range(18) if (i + 1) % 6)
    assert [t.shape[0] for t in pool.layers] == [4 if i in pool.window_layers else 10 for i in range(18)]
    assert pool.data.shape[0] == 3
    whole = KVPool(cfg, 10, PAGE, torch.float32, torch.device("cpu"))
    assert whole.window is None and whole.window_layers == frozenset()
    assert all(t.shape[0] == 10 for t in whole.layers)


def test_split_pages_gives_windows_their_seats_and_full_layers_the_rest():
    # Gemma 3 270M, 2 GiB of float32 KV (3640 whole-model pages), 64 seats, chunks of 1024
    num_full, num_window = split_pages(3640, 18, 15, 512, PAGE, 64, 1024)
    assert num_window == 64 * 33 + 4 * max_window_pages(512, PAGE, 1024)
    assert num_full * 3 + num_window * 15 <= 3640 * 18
    assert num_full == 9340  # 149k tokens of the global layers, against 3640 x 16 = 58k in a whole-model pool
    # a small pool: windows get at most three quarters of it
    num_full, num_window = split_pages(100, 18, 15, 512, PAGE, 64, 1024)
    assert num_window * 15 <= 100 * 18 * 3 // 4 and num_full >= 1
    # every layer windowed (Mistral): the full pages hold no bytes, their count bounds admission only
    assert split_pages(100, 4, 4, 64, PAGE, 8, 64)[0] == 400


def test_a_move_takes_its_pages_and_window_whole_or_nothing():
    kv, window = KVManager(100, PAGE), _window_kv(num_pages=40)
    taken = reserve_move(kv, window, 1000)
    assert taken is not None
    pages, promised = taken
    assert len(pages) == 63 and promised is not None and window.manager.num_promised == 33
    assert reserve_move(kv, window, 700) is None and kv.num_used == 63  # 37 pages free: 44 needed
    other = KVManager(100, PAGE)
    assert reserve_move(other, window, 1000) is None and other.num_used == 0  # 7 window pages left, 33 needed
    assert window.manager.num_promised == 33
    kv.free(pages)
    promised.release()
    assert kv.num_used == 0 and window.manager.num_promised == 0
    alone = reserve_move(kv, None, 20)  # a model without windowed layers
    assert alone is not None and len(alone[0]) == 2 and alone[1] is None
