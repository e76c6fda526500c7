"""The engine's paths with sliding-window layers: a tiny random Gemma 3 (window 20, longer than a page of 16,
shorter than the prompts) through every mode, the prefix cache and live migration, token for token as
transformers generates, every page back. The same test bodies as the Llama-layout model's, with this model's
fixtures: the paths that move or share KV must stay exact when layers see only their window.

Both settings of kv.window_pages: "free" (the default: windowed layers hold their window's pages only; handoffs and
moves copy the last window, the prefix cache needs it cached) and "keep" (every page of every layer)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from nodeserve.config import config_from_dict
from nodeserve.model.loader import load_model
from tests.runtime import test_engine, test_migration, test_prefix_cache
from tests.model.test_families import NUM_NEW_TOKENS, build_hf, hf_greedy as transformers_greedy, write_gguf
from tests.model.test_gguf_loader import VOCAB
# The bodies below run again here, on this module's fixtures.
from tests.runtime.test_engine import test_greedy_matches_transformers_in_every_mode  # noqa: F401
from tests.runtime.test_migration import \
    test_live_and_stop_and_copy_moves_keep_the_tokens_and_free_every_page  # noqa: F401
from tests.runtime.test_prefix_cache import _config, _conversation, _run, prompts  # noqa: F401
from tests.runtime.test_engine import _greedy, _tokens
from tests.runtime.test_tensor_parallel import GROUPINGS


def _window_pages(monkeypatch, setting: str) -> None:
    """The imported test bodies build their configs with config_from_dict: each gets kv.window_pages = setting."""
    def with_setting(d, *args, **kwargs):
        return config_from_dict({**d, "kv": {**d.get("kv", {}), "window_pages": setting}}, *args, **kwargs)
    for module in (test_engine, test_migration, test_prefix_cache):
        monkeypatch.setattr(module, "config_from_dict", with_setting)


@pytest.fixture(autouse=True)
def keep_windows(monkeypatch):
    """The imported bodies run with every page kept; the tests named window_pages_freed run them again freed."""
    _window_pages(monkeypatch, "keep")


@pytest.fixture(scope="module")
def gemma_hf():
    hf = build_hf("gemma3", sliding_window=20)
    assert hf.config.sliding_window == 20
    return hf


@pytest.fixture(scope="module")
def loaded_fp32(gemma_hf, tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma") / "gemma.gguf"
    write_gguf(path, "gemma3", gemma_hf, QT.Q8_0)
    loaded = load_model(str(path), torch.float32, tp_degrees=(2,))  # tensor-parallel groups of two too
    assert set(loaded.config.layer_windows) == {20, 0}
    return loaded


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [rng.integers(0, VOCAB, size=n).tolist() for n in (7, 25, 33, 50, 4, 6, 15, 16)]  # [4:] as short as the raw prompts


@pytest.fixture(scope="module")
def hf_greedy(gemma_hf, prompt_ids) -> list[list[int]]:
    return transformers_greedy(gemma_hf, prompt_ids)


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_the_prefix_cache_changes_no_token(mode, loaded_fp32, prompts):  # noqa: F811
    """Shared, concurrent and aborted prefixes (test_prefix_cache's conversation): the same tokens with the cache
    on and off, and the later turns start from the earlier ones' pages."""
    body = lambda engine: _conversation(engine, prompts)  # noqa: E731
    (on, cached_on), stats, _ = _run(_config(mode, True), loaded_fp32, body)
    (off, _), _, _ = _run(_config(mode, False), loaded_fp32, body)
    assert on == off
    assert cached_on[1] == cached_on[2] == 48 and cached_on[3] == 64
    assert all(s.whole for s in stats)


@pytest.mark.parametrize("mode", ["disaggregated", "colocated", "conditional", "busy-local", "adaptive",
                                  "colocated tp2", "tp2 -> tp1"])
def test_window_pages_freed_keep_the_tokens_in_every_mode(mode, monkeypatch, loaded_fp32, prompt_ids, hf_greedy):
    """kv.window_pages = "free": prompts past the window (25, 33, 50 tokens over a window of 20) prefill in chunks
    that drop the pages behind them, hand only their last window over, and decode on a window of pages."""
    _window_pages(monkeypatch, "free")
    monkeypatch.setitem(test_engine.MODES, "adaptive", {"mode": "adaptive", "devices": ["cpu:0", "cpu:1"]})
    for name in ("colocated tp2", "tp2 -> tp1"):  # tensor-parallel groups: each rank's shard has window pages
        monkeypatch.setitem(test_engine.MODES, name, GROUPINGS[name])
    test_greedy_matches_transformers_in_every_mode(mode, loaded_fp32, prompt_ids, hf_greedy)


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_window_pages_freed_keep_prefixes_cached_and_leak_nothing(mode, monkeypatch, loaded_fp32, prompts):
    """With window pages freed, the prefix cache takes a cached prefix as far as its last window's pages are cached
    too (they stay cached after the window slides past them): the same tokens as with the cache off, the same
    prefixes reused as with every page kept, and every full and window page back, promises included, after the
    conversation's aborted request too."""
    _window_pages(monkeypatch, "free")
    body = lambda engine: _conversation(engine, prompts)  # noqa: E731
    windows = []

    async def with_windows(engine):
        windows.extend(w.window for w in engine.workers)
        return await body(engine)

    (on, cached_on), stats, _ = test_prefix_cache._run(test_prefix_cache._config(mode, True), loaded_fp32,
                                                       with_windows)
    (off, _), _, _ = test_prefix_cache._run(test_prefix_cache._config(mode, False), loaded_fp32, body)
    assert on == off
    assert cached_on[1] == cached_on[2] == 48 and cached_on[3] == 64
    assert all(s.whole for s in stats)
    assert windows and all(w is not None for w in windows)
    assert all(w.manager.num_used == 0 and w.manager.num_promised == 0 for w in windows)
    assert any(w.manager.num_cached for w in windows)


def test_a_prefix_whose_last_window_was_evicted_is_computed_again(monkeypatch, loaded_fp32, prompts):
    """The full layers' pages of a prefix alone are no hit: with the window pages dropped from the cache, the next
    turn computes its prompt whole, and its tokens stay those of a cold run."""
    _window_pages(monkeypatch, "free")

    async def body(engine):
        first = await _tokens(engine.add_request(prompts[0], _greedy(max_tokens=8)))
        for w in engine.workers:
            w.window.manager.drop_cached()
        again = engine.add_request(prompts[1], _greedy(max_tokens=8))
        return [first[0], (await _tokens(again))[0]], again.request.num_cached_tokens

    (tokens, num_cached), stats, num_main_cached = test_prefix_cache._run(
        test_prefix_cache._config("colocated", True), loaded_fp32, body)
    (cold, _), _, _ = test_prefix_cache._run(test_prefix_cache._config("colocated", False), loaded_fp32, body)
    assert num_cached == 0 and sum(num_main_cached) > 0
    assert tokens == cold
    assert all(s.whole for s in stats)


def test_window_pages_freed_move_live_and_by_stop_and_copy(monkeypatch, loaded_fp32, prompt_ids):
    """A decoding request moves with its full layers' pages in pre-copy rounds and its windowed layers' last
    window when it stops: the same tokens as unmoved, every page back on both devices."""
    _window_pages(monkeypatch, "free")
    test_live_and_stop_and_copy_moves_keep_the_tokens_and_free_every_page(loaded_fp32, prompt_ids)


def test_kv_tiers_keep_the_tokens_with_every_page_kept(loaded_fp32):
    """kv.window_pages = "keep": pages a small pool evicts come back from the host tier, with the same tokens as
    without it and as with window pages freed (where the tiers are off)."""
    from nodeserve.kv.pool import KVPool
    from tests.runtime import test_kv_tiers

    rng = np.random.default_rng(5)
    a, b, c = (rng.integers(0, VOCAB, size=200).tolist() for _ in range(3))
    convo = (a, b, c, a + rng.integers(0, VOCAB, size=9).tolist())
    pool_gib = 16 * KVPool.bytes_per_page(loaded_fp32.config, 16, torch.float32) / 2**30  # 16 pages a device

    def run(host_gib: float, setting: str):
        config = test_kv_tiers._config("colocated", pool_gib, host_gib, window_pages=setting)
        return test_kv_tiers._run(config, loaded_fp32, lambda e: test_kv_tiers._evict_and_return(e, convo))

    off, cached_off, _ = run(0, "keep")
    on, cached_on, sources = run(0.05, "keep")
    freed, _, freed_sources = run(0.05, "free")
    assert on == off == freed
    assert cached_off < 16 * 4 and cached_on >= 200 - 2 * 16 and sources.get("host", 0) > 0, sources
    assert "host" not in freed_sources



@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_verify_steps_keep_the_tokens_on_windowed_layers(mode, loaded_fp32, gemma_hf):
    """Prompt lookup on prompts that repeat themselves past the window, every guess verified (adaptive off): a
    verify row attends as a decode row, within its layer's window, and greedy output stays transformers' token
    for token. (With window_pages = "free" a request does not speculate: its window pages grow one a step.)"""
    from tests.runtime.test_speculative import _run as run_counting

    prompts = [([5, 9, 14, 3, 27, 8] * 6)[:n] for n in (30, 36)] + [([40, 41, 42, 43, 44] * 8)[:n] for n in (25, 40)]
    want = transformers_greedy(gemma_hf, prompts)
    config = config_from_dict({"model": {"dtype": "float32"}, "devices": test_engine.MODES[mode],
                               "kv": {"memory_gib": 0.25, "page_size": 16, "window_pages": "keep"},
                               "speculative": {"method": "prompt_lookup", "adaptive": False}})

    async def body(engine):
        return await asyncio.gather(*(_tokens(engine.add_request(p, _greedy(max_tokens=NUM_NEW_TOKENS)))
                                      for p in prompts))
    results, (drafted, accepted) = run_counting(config, loaded_fp32, body)
    assert [r[0] for r in results] == want
    assert 0 < accepted <= drafted
