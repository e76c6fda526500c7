"""Engine end to end on the real model: same tokens as transformers in every mode, and no page ever leaked."""

from __future__ import annotations

import asyncio

import pytest

from nodeserve.config import ConfigError, config_from_dict
from nodeserve.runtime.memory import check_fits, weight_bytes
from nodeserve.runtime.engine import Engine, PromptTooLong, QueueFull, TooLarge
from nodeserve.core.scheduler import FORWARD_FAILED
from nodeserve.core.sampling_params import SamplingParams

MODES = {
    # every prompt through the prefill device and a KV transfer
    "disaggregated": {"mode": "disaggregated", "prefill": ["cpu:0"], "decode": ["cpu:1"],
                      "local_prefill_when_busy": 0},
    "colocated": {"mode": "colocated", "devices": ["cpu:0", "cpu:1"]},
    "conditional": {"mode": "disaggregated", "prefill": ["cpu:0"], "decode": ["cpu:1"],
                    "local_prefill_threshold": 30, "local_prefill_when_busy": 0},
    # the default: a short prompt prefills on the decode device while the prefill device has a queue
    "busy-local": {"mode": "disaggregated", "prefill": ["cpu:0"], "decode": ["cpu:1"],
                   "local_prefill_when_busy": 64},
}


def _config(mode: str, **scheduler):
    return config_from_dict({"model": {"dtype": "float32", "quantization": "none"}, "devices": MODES[mode],
                             "kv": {"memory_gib": 0.25, "page_size": 16},
                             "scheduler": {"max_num_batched_tokens": 48, **scheduler}})


def _run(config, loaded, body):
    """Starts an engine on a fresh loop, runs `body(engine)`, checks every pool is whole again, stops."""
    async def main():
        engine = Engine(config, loaded)
        engine.start(asyncio.get_running_loop())
        try:
            result = await body(engine)
            await _wait_pools_whole(engine)
            return result
        finally:
            engine.stop()
    return asyncio.run(main())


async def _wait_pools_whole(engine: Engine, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.05)):
        if all(s.whole for s in engine.pool_stats()):
            return
        await asyncio.sleep(0.05)
    pytest.fail(f"KV pages leaked: {engine.pool_stats()}")


async def _tokens(stream) -> tuple[list[int], str]:
    out, finish = [], None
    async for ev in stream:
        if ev.token_id is not None:
            out.append(ev.token_id)
        finish = ev.finish_reason
    return out, finish


def _greedy(max_tokens=32, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


@pytest.mark.parametrize("mode", ["disaggregated", "colocated", "conditional"])
def test_greedy_matches_transformers_in_every_mode(mode, loaded_fp32, prompt_ids, hf_greedy):
    async def body(engine):
        results = await asyncio.gather(*(_tokens(engine.add_request(ids, _greedy())) for ids in prompt_ids))
        return [r[0] for r in results], [r[1] for r in results]
    tokens, finishes = _run(_config(mode), loaded_fp32, body)
    assert tokens == hf_greedy
    assert finishes == ["length"] * len(prompt_ids)


def test_a_short_prompt_behind_a_long_one_prefills_on_the_decode_device(loaded_fp32, prompt_ids, hf_greedy):
    short = min(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    assert len(prompt_ids[short]) < 64

    async def body(engine):
        long = engine.add_request([1000 + i % 500 for i in range(400)], _greedy(max_tokens=2))  # 9 chunks of 48
        await asyncio.sleep(0.05)
        out, _ = await _tokens(engine.add_request(prompt_ids[short], _greedy()))
        await _tokens(long)
        return out, engine.router.placer.num_busy_local
    tokens, num_local = _run(_config("busy-local"), loaded_fp32, body)
    assert num_local == 1 and tokens == hf_greedy[short]


def test_the_decode_devices_own_prompt_tokens_are_sized_by_its_step_model(loaded_fp32, prompt_ids, hf_greedy):
    """With the start-up profile (warmup), scheduler.decode_prefill_chunk = 0 sizes the decode device's own prompt
    tokens per step by its step model (core/side_prefill.py); a number keeps that fixed chunk. Same tokens."""
    short = min(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))

    async def body(engine):
        await asyncio.to_thread(engine.warmup)
        long = engine.add_request([1000 + i % 500 for i in range(400)], _greedy(max_tokens=2))
        await asyncio.sleep(0.05)
        out, _ = await _tokens(engine.add_request(prompt_ids[short], _greedy()))
        await _tokens(long)
        return out, [w.scheduler.side_prefill is not None for w in engine.workers]
    for chunk, want in ((0, [False, True]), (16, [False, False])):
        tokens, sized = _run(_config("busy-local", decode_prefill_chunk=chunk), loaded_fp32, body)
        assert tokens == hf_greedy[short] and sized == want


@pytest.mark.slow
def test_one_request_alone_equals_it_among_31_others(loaded_fp32, prompt_ids, hf_greedy):
    async def body(engine):
        alone = await _tokens(engine.add_request(prompt_ids[0], _greedy()))
        crowd = [engine.add_request(prompt_ids[i % len(prompt_ids)], _greedy()) for i in range(32)]
        together = await asyncio.gather(*(_tokens(s) for s in crowd))
        return alone[0], [t[0] for t in together]
    alone, together = _run(_config("disaggregated"), loaded_fp32, body)
    assert alone == hf_greedy[0]
    assert together == [hf_greedy[i % len(prompt_ids)] for i in range(32)]


def test_eos_stops_unless_ignored(loaded_fp32, prompt_ids):
    async def body(engine):
        stopped = await _tokens(engine.add_request(prompt_ids[0], SamplingParams(max_tokens=32, temperature=0)))
        return stopped
    tokens, finish = _run(_config("disaggregated"), loaded_fp32, body)
    assert finish == "stop" and tokens[-1] in loaded_fp32.tokenizer.eos_token_ids and len(tokens) < 32


def test_max_tokens_one_finishes_on_the_prefill_device(loaded_fp32, prompt_ids, hf_greedy):
    async def body(engine):
        return await _tokens(engine.add_request(prompt_ids[1], _greedy(max_tokens=1)))
    assert _run(_config("disaggregated"), loaded_fp32, body) == (hf_greedy[1][:1], "length")


@pytest.mark.slow
def test_aborts_free_pages_on_both_devices_at_every_stage(loaded_fp32, prompt_ids):
    long_prompt = (prompt_ids[6] * 40)[:600]  # several prefill chunks: aborts land mid-prefill and mid-transfer

    async def body(engine):
        streams = []
        for i in range(12):
            # The aborted ones run long enough to be aborted mid-decode; the two that finish need not.
            streams.append(engine.add_request(long_prompt if i % 2 else prompt_ids[i % 8],
                                              _greedy(max_tokens=200 if i < 10 else 24)))
        # Abort some immediately (pending or mid-prefill), some after a few tokens (decoding).
        for s in streams[:4]:
            engine.abort(s)
        got = 0
        async for ev in streams[5]:
            got += 1
            if got == 3:
                break
        for s in streams[4:10]:
            engine.abort(s)
        rest = await asyncio.gather(*(_tokens(s) for s in streams[10:]))
        return [f for _, f in rest]
    assert _run(_config("disaggregated"), loaded_fp32, body) == ["length", "length"]


def test_fault_in_one_request_fails_only_that_request(loaded_fp32, prompt_ids, hf_greedy):
    poison = 49151  # a vocabulary id the prompts never contain

    async def body(engine):
        for w in engine.workers:
            run = w.runner.run

            def faulty(chunks, *hooks, run=run):
                if any(poison in c.token_ids for c in chunks):
                    raise RuntimeError("injected fault")
                return run(chunks, *hooks)
            w.runner.run = faulty
        good = [engine.add_request(ids, _greedy()) for ids in prompt_ids[:3]]
        bad = engine.add_request(prompt_ids[3] + [poison], _greedy())
        bad_events = [ev async for ev in bad]
        return await asyncio.gather(*(_tokens(s) for s in good)), bad_events
    good, bad_events = _run(_config("disaggregated"), loaded_fp32, body)
    assert [g[0] for g in good] == hf_greedy[:3]
    # What reaches the client names the failure but no exception text (that goes to the log).
    assert bad_events[-1].finish_reason == "error" and bad_events[-1].error == FORWARD_FAILED


def test_failed_kv_copy_fails_only_the_requests_it_carried(loaded_fp32, prompt_ids, hf_greedy):
    """A copy that raises (a device fault on the pair) ends the request whose pages it carried with an error; the
    copy thread lives on, the other requests decode as usual, and no page on either device is leaked."""
    async def body(engine):
        transfer = engine.transfers[0]
        copy_pages = transfer._copy_pages

        def faulty(layer, pages):
            if "bad" in pages.request_ids and layer == 5:
                raise RuntimeError("injected copy fault")
            return copy_pages(layer, pages)
        transfer._copy_pages = faulty
        bad = engine.add_request(prompt_ids[3], _greedy(), request_id="bad")
        bad_events = [ev async for ev in bad]
        good = await asyncio.gather(*(_tokens(engine.add_request(ids, _greedy())) for ids in prompt_ids[:3]))
        return [g[0] for g in good], bad_events
    good, bad_events = _run(_config("disaggregated"), loaded_fp32, body)
    assert good == hf_greedy[:3]
    # Its first token, sampled by the prefill step, reaches it unless the copy (which overlaps that step layer by
    # layer) failed first: which comes first depends on thread timing on a loaded machine.
    tokens = [ev.token_id for ev in bad_events]
    assert tokens in ([hf_greedy[3][0], None], [None])
    assert bad_events[-1].finish_reason == "error" and "injected" not in bad_events[-1].error
    assert bad_events[-1].error.startswith("KV transfer kv cpu:0->cpu:1 failed")


def test_an_event_loop_blocked_for_a_second_loses_nothing(loaded_fp32, prompt_ids, hf_greedy):
    """A handler that blocks the loop for 1 s (a slow tokenizer call, a GC pause): the workers keep stepping, the
    tokens they produce meanwhile queue up and arrive in order, an abort issued right after the block still frees
    its pages, and every request that was not aborted gets transformers' tokens."""
    import time

    async def body(engine):
        streams = [engine.add_request(ids, _greedy()) for ids in prompt_ids[:4]]
        doomed = engine.add_request(prompt_ids[4], _greedy(max_tokens=400))
        await asyncio.sleep(0.05)
        time.sleep(1.0)  # blocks the loop: no callback, no token delivery, no dispatch
        engine.abort(doomed)
        results = await asyncio.gather(*(_tokens(s) for s in streams))
        doomed_events = [ev async for ev in doomed]
        return results, doomed_events
    results, doomed_events = _run(_config("disaggregated"), loaded_fp32, body)
    assert [r[0] for r in results] == hf_greedy[:4]
    assert [r[1] for r in results] == ["length"] * 4
    assert doomed_events[-1].finish_reason == "abort"


def test_a_grammar_whose_mask_is_too_slow_ends_its_request_only(loaded_fp32, prompt_ids, hf_greedy):
    """A grammar whose mask fill takes longer than the budget in a step (one uninterruptible Rust call in real
    life) ends its own request with an error naming the limit; the requests decoding beside it are untouched."""
    import time

    from nodeserve.sampling.constrain import MASK_FILL_BUDGET_S

    class SlowMatcher:
        def is_finished(self):
            return False

        def fill_next_token_bitmask(self, bitmask, row):
            time.sleep(MASK_FILL_BUDGET_S * 1.5)

        def consume_token(self, token):
            return True

    async def body(engine):
        good = [engine.add_request(ids, _greedy()) for ids in prompt_ids[:3]]
        slow = engine.add_request(prompt_ids[3], _greedy(), grammar=SlowMatcher())
        slow_events = [ev async for ev in slow]
        return await asyncio.gather(*(_tokens(s) for s in good)), slow_events
    good, slow_events = _run(_config("disaggregated"), loaded_fp32, body)
    assert [g[0] for g in good] == hf_greedy[:3]
    assert [ev.token_id for ev in slow_events] == [None]  # ended at its first token, on the prefill device
    assert slow_events[-1].finish_reason == "error"
    assert f"over the limit of {MASK_FILL_BUDGET_S * 1000:.0f} ms" in slow_events[-1].error


def test_a_forced_page_hash_collision_never_reuses_another_prompts_kv(loaded_fp32, prompt_ids, hf_greedy,
                                                                       monkeypatch):
    """Page hashes made to depend on the page's position only, so every prompt's pages collide with every other
    prompt's: the second prompt finds the first one's pages under its hashes, sees they hold other tokens, and
    computes its own KV, so both get transformers' tokens; every page comes back."""
    import nodeserve.core.scheduler as scheduler_module
    import nodeserve.runtime.router as router_module

    def positional(token_ids, page_size, parent=None):
        start = 0 if parent is None else int.from_bytes(parent[:8], "big") + 1
        return [(start + i).to_bytes(8, "big") * 2 for i in range(len(token_ids) // page_size)]
    monkeypatch.setattr(router_module, "hash_pages", positional)
    monkeypatch.setattr(scheduler_module, "hash_pages", positional)
    first, second = sorted(range(len(prompt_ids)), key=lambda i: -len(prompt_ids[i]))[:2]  # 2+ full pages each
    assert min(len(prompt_ids[first]), len(prompt_ids[second])) > 2 * 16

    async def body(engine):
        a = await _tokens(engine.add_request(prompt_ids[first], _greedy()))
        b = await _tokens(engine.add_request(prompt_ids[second], _greedy()))
        return a[0], b[0], sum(w.kv.num_collisions for w in engine.workers)
    a, b, num_collisions = _run(_config("disaggregated"), loaded_fp32, body)
    assert a == hf_greedy[first] and b == hf_greedy[second]
    assert num_collisions >= 1


def test_a_fault_while_placing_one_request_fails_only_that_request(loaded_fp32, prompt_ids, hf_greedy):
    """A placement that raises for one request (a bug met at admission) ends that request with an error and takes
    it out of the queue: the requests queued behind it are placed, and every page it took comes back."""
    from nodeserve.runtime.engine import PLACEMENT_FAILED

    async def body(engine):
        router = engine.router
        send = router._send

        def faulty(req, *args):
            if req.request_id == "bad":
                raise RuntimeError("injected placement fault")
            return send(req, *args)
        router._send = faulty
        bad = engine.add_request(prompt_ids[3], _greedy(), request_id="bad")
        good = [engine.add_request(ids, _greedy()) for ids in prompt_ids[:3]]
        bad_events = [ev async for ev in bad]
        return await asyncio.gather(*(_tokens(s) for s in good)), bad_events, router.num_pending
    good, bad_events, num_pending = _run(_config("disaggregated"), loaded_fp32, body)
    assert [g[0] for g in good] == hf_greedy[:3]
    assert [(ev.finish_reason, ev.error) for ev in bad_events] == [("error", PLACEMENT_FAILED)]
    assert num_pending == 0


def test_admission_errors(loaded_fp32, prompt_ids):
    async def body(engine):
        with pytest.raises(PromptTooLong, match="maximum context length is 8192 tokens.*10000 input tokens"):
            engine.add_request([1] * 10_000, _greedy())
        return True
    assert _run(_config("disaggregated"), loaded_fp32, body)


def test_full_queue_is_refused_then_drains(loaded_fp32, prompt_ids):
    cfg = config_from_dict({"model": {"dtype": "float32"}, "devices": MODES["disaggregated"],
                            "kv": {"memory_gib": 0.01, "page_size": 16}, "server": {"max_waiting": 2}})

    async def body(engine):
        streams, refused = [], 0
        for _ in range(12):
            try:
                streams.append(engine.add_request(prompt_ids[0], _greedy(max_tokens=16)))
            except QueueFull:
                refused += 1
        results = await asyncio.gather(*(_tokens(s) for s in streams))
        return refused, [len(t) for t, _ in results]
    refused, lengths = _run(cfg, loaded_fp32, body)
    assert refused > 0 and lengths == [16] * (12 - refused)


def test_a_gpu_too_small_for_the_weights_or_the_pool_is_a_config_error(loaded_fp32):
    gib = 2**30
    weights = weight_bytes(loaded_fp32.model)
    assert 500e6 < weights < 600e6  # SmolLM2-135M in float32 (tied embeddings counted once)
    check_fits("cuda:0", 80 * gib, 16 * gib, 60 * gib)
    with pytest.raises(ConfigError, match=r"weights \(65.0 GiB\) do not fit in cuda:3's free memory \(40.0 GiB\)"):
        check_fits("cuda:3", 40 * gib, 65 * gib, 0)
    with pytest.raises(ConfigError, match=r"'kv.memory_gib' = 30 does not fit in cuda:1: 40.0 GiB free, 16.0 GiB"):
        check_fits("cuda:1", 40 * gib, 16 * gib, 30 * gib)


def test_drain_error_after_a_token_reaches_the_reader(loaded_fp32, prompt_ids):
    """fail_all (the drain timeout) after a token: the reader gets the error, not a normal-looking end."""
    async def body(engine):
        stream = engine.add_request(prompt_ids[0], _greedy(max_tokens=200))
        events = [await anext(aiter(stream))]
        engine.fail_all("the server is shutting down")
        events += [ev async for ev in stream]
        return events
    events = _run(_config("disaggregated"), loaded_fp32, body)
    assert events[0].token_id is not None
    assert events[-1].finish_reason == "error" and events[-1].error == "the server is shutting down"


def test_abort_wakes_a_reader_waiting_for_the_next_token(loaded_fp32, prompt_ids):
    """With n > 1 a failing choice aborts its siblings while their readers wait: each must end, not hang."""
    async def body(engine):
        streams = [engine.add_request(prompt_ids[i], _greedy(max_tokens=200)) for i in range(2)]
        readers = [asyncio.create_task(_tokens(s)) for s in streams]
        await asyncio.sleep(0.2)
        for s in streams:
            engine.abort(s)
        done, _ = await asyncio.wait(readers, timeout=10)
        return [r.result()[1] for r in done]
    assert _run(_config("disaggregated"), loaded_fp32, body) == ["abort", "abort"]


def test_max_tokens_is_clamped_to_what_a_pool_can_ever_hold(loaded_fp32, prompt_ids):
    """A chat request without max_tokens (the server's default 2048) on a small pool runs until the pool's limit
    instead of a 400 that tells the client to lower a max_tokens it never sent; a prompt the pool cannot hold
    is refused, naming the prompt."""
    cfg = config_from_dict({"model": {"dtype": "float32"}, "devices": MODES["disaggregated"],
                            "kv": {"memory_gib": 0.005, "page_size": 16}})

    async def body(engine):
        capacity = engine.decode_workers[0].pool.manager.num_usable * 16
        with pytest.raises(TooLarge, match=f"the prompt has {capacity + 1} tokens"):
            engine.add_request([1] * (capacity + 1), _greedy())
        tokens, finish = await _tokens(engine.add_request(prompt_ids[0], _greedy(max_tokens=2048)))
        return capacity, len(tokens), finish
    capacity, num_tokens, finish = _run(cfg, loaded_fp32, body)
    assert capacity == 7 * 16  # 5 MiB of float32 KV for SmolLM2: 7 pages
    assert (num_tokens, finish) == (capacity - len(prompt_ids[0]) + 1, "length")


def test_a_fault_outside_the_step_does_not_kill_the_worker(loaded_fp32, prompt_ids, hf_greedy):
    """The inbox and the abort sweep run inside the loop's guard: a bug there fails what is in flight and the
    worker keeps serving, instead of its thread dying silently with every later request waiting forever."""
    async def body(engine):
        decode = engine.decode_workers[0]
        sweep, faults = decode.scheduler.drop_aborted, [1]

        def faulty():
            if faults and decode.scheduler.running:
                faults.pop()
                raise RuntimeError("injected sweep fault")
            return sweep()
        decode.scheduler.drop_aborted = faulty
        first = await asyncio.wait_for(_tokens(engine.add_request(prompt_ids[0], _greedy())), 60)
        second = await asyncio.wait_for(_tokens(engine.add_request(prompt_ids[1], _greedy())), 60)
        return first[1], second, engine.dead_threads()
    first_finish, second, dead = _run(_config("disaggregated"), loaded_fp32, body)
    assert first_finish == "error" and second == (hf_greedy[1], "length") and dead == []


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_worker_thread_is_reported(loaded_fp32, prompt_ids):
    """If a worker's thread does die, the engine names it (/health then answers 503)."""
    async def main():
        engine = Engine(_config("disaggregated"), loaded_fp32)
        engine.start(asyncio.get_running_loop())
        try:
            decode = engine.decode_workers[0]

            def broken(*args, **kwargs):
                raise RuntimeError("injected fault")
            decode._step = decode.scheduler.fail_all = broken
            engine.add_request(prompt_ids[0], _greedy())
            for _ in range(200):
                if engine.dead_threads():
                    break
                await asyncio.sleep(0.05)
            return engine.dead_threads()
        finally:
            engine.stop()
    assert asyncio.run(main()) == ["cpu:1"]


@pytest.mark.slow
def test_a_stuck_transfer_stops_the_watchdog(loaded_fp32, prompt_ids, hf_greedy):
    """A copy thread stuck mid-job stalls its prefill worker's requests: the worker's progress must say so, or
    the watchdog keeps pinging systemd for a server that no longer serves."""
    import threading

    from nodeserve.server.systemd import workers_healthy

    async def body(engine):
        transfer, release = engine.transfers[0], threading.Event()
        copy_pages = transfer._copy_pages

        def stuck(layer, pages):
            release.wait(30)
            return copy_pages(layer, pages)
        transfer._copy_pages = stuck
        healthy = workers_healthy(engine.workers, max_stall=2.0)  # an idle worker turns every 0.5 s
        stream = engine.add_request(prompt_ids[0], _greedy())
        await asyncio.sleep(4.0)
        stalled = not healthy()
        release.set()
        tokens = await _tokens(stream)
        await asyncio.sleep(1.0)
        return stalled, healthy(), tokens
    stalled, healthy_after, tokens = _run(_config("disaggregated"), loaded_fp32, body)
    assert stalled and healthy_after and tokens == (hf_greedy[0], "length")
