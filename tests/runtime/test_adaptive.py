"""Adaptive mode end to end on the real model: the same tokens as transformers while devices change role under
requests in flight (a newly dedicated prefill device's decodes move to the other device mid-generation),
prompts prefilled on one device and decoded on the other (both ways) or colocated, aborts among them, and no
page leaked. The cost model is synthetic (these engines skip the start-up profile), so which
prompts count as long is set by the test."""

from __future__ import annotations

import pytest
import asyncio

from nodeserve.core.cost_model import CostModel, StepModel
from nodeserve.core.placement import SloTarget, StepLimits
from nodeserve.core.placer import AdaptivePlacer
from nodeserve.core.roles import LONG_PREFILL_TPOTS
from nodeserve.config import config_from_dict
from nodeserve.runtime.engine import Engine
from tests.runtime.test_engine import _greedy, _tokens, _wait_pools_whole

SECONDS_PER_PROMPT_TOKEN = 1e-3


def _install_placer(engine: Engine, long_from: int) -> AdaptivePlacer:
    """A placer on a cost model where prompts of `long_from` tokens or more are long, and demand that fades at
    once (so devices go back to adaptive within the test)."""
    cost = CostModel({w.name: StepModel([0.0, SECONDS_PER_PROMPT_TOKEN, 0.0, 0.01, 0.0]) for w in engine.workers})
    tpot = (long_from - 0.5) * SECONDS_PER_PROMPT_TOKEN / LONG_PREFILL_TPOTS
    placer = AdaptivePlacer(lambda: cost, StepLimits(48, 64), SloTarget(1000.0, tpot), [w.name for w in engine.workers])
    placer.policy.window_s, placer.policy.hold_s, placer.policy.idle_s = 0.5, 0.0, 0.5
    engine.router.use_policy(engine.router.admission, placer)
    return placer


@pytest.mark.slow
def test_tokens_match_transformers_while_devices_change_role(loaded_fp32, prompt_ids, hf_greedy):
    cfg = config_from_dict({"model": {"dtype": "float32"}, "devices": {"mode": "adaptive",
                                                                        "devices": ["cpu:0", "cpu:1"]},
                            "kv": {"memory_gib": 0.25, "page_size": 16}, "scheduler": {"max_num_batched_tokens": 48}})
    lengths = sorted(len(p) for p in prompt_ids)
    long_from = lengths[len(lengths) // 2]  # the longer half of the prompts are long
    doomed_prompt = (prompt_ids[6] * 40)[:400]

    async def main():
        engine = Engine(cfg, loaded_fp32)
        engine.start(asyncio.get_running_loop())
        try:
            placer = _install_placer(engine, long_from)
            short = [i for i, p in enumerate(prompt_ids) if len(p) < long_from]
            long = [i for i, p in enumerate(prompt_ids) if len(p) >= long_from]
            # Short requests decode on both devices; long prompts then make one a prefill device under them,
            # an abort lands mid-prefill, and after the demand fades the device takes decodes again.
            streams = {i: engine.add_request(prompt_ids[i], _greedy()) for i in short}
            await asyncio.sleep(0.3)
            doomed = engine.add_request(doomed_prompt, _greedy())
            streams |= {i: engine.add_request(prompt_ids[i], _greedy()) for i in long}
            await asyncio.sleep(0.2)
            engine.abort(doomed)
            results = {i: await _tokens(s) for i, s in streams.items()}
            await asyncio.sleep(0.6)
            again = await _tokens(engine.add_request(prompt_ids[short[0]], _greedy()))
            await _wait_pools_whole(engine)
            copied = {t.name: len(t.records) for t in engine.transfers}
            moved = engine.router.num_migrations["moved"]
            return results, again, list(engine.router.role_changes), copied, engine.pool_stats(), moved
        finally:
            engine.stop()

    results, again, changes, copied, stats, num_moved = asyncio.run(main())
    assert [results[i][0] for i in range(len(prompt_ids))] == hf_greedy
    assert again[0] == hf_greedy[sorted(i for i, p in enumerate(prompt_ids) if len(p) < long_from)[0]]
    roles = [(c.device, c.role) for c in changes]
    assert roles[0][1] == "prefill" and ("adaptive" in [r for _, r in roles[1:]])  # dedicated, then given back
    assert sum(copied.values()) > 0  # long prompts moved their KV from the prefill device
    assert num_moved > 0  # and the dedicated device's decodes moved to the other, mid-generation
    assert all(s.whole for s in stats)
    assert sum(s.num_role_changes for s in stats) == len(changes)


@pytest.mark.slow
def test_a_request_waiting_for_a_seat_is_placed_once_the_prefill_device_has_nothing_queued(loaded_fp32, prompt_ids,
                                                                                           hf_greedy):
    """Two seats a device, one request decoding on each. A long prompt dedicates one device to its prefill and
    takes the other's last seat; a short prompt then finds no seat and waits. Once the long prompt is prefilled and
    sent, the prefill device has nothing queued and goes back to decoding (core/roles.py: for want of seats, or here,
    the demand having faded, for want of long prompts), and the short prompt is placed there then (Engine._room),
    not when a decode ends: before, nothing dispatched the router until one did, and the prefill device idled."""
    cfg = config_from_dict({"model": {"dtype": "float32"}, "devices": {"mode": "adaptive",
                                                                        "devices": ["cpu:0", "cpu:1"]},
                            "kv": {"memory_gib": 0.25, "page_size": 16},
                            "scheduler": {"max_num_batched_tokens": 48, "max_num_seqs": 2}})
    lengths = sorted(len(p) for p in prompt_ids)
    short = [i for i, p in enumerate(prompt_ids) if len(p) == lengths[0]][0]
    background = [i for i in range(len(prompt_ids)) if i != short][:2]
    long_prompt = (prompt_ids[6] * 40)[:400]  # 9 chunks of 48

    async def main():
        engine = Engine(cfg, loaded_fp32)
        engine.start(asyncio.get_running_loop())
        loop = asyncio.get_running_loop()
        try:
            _install_placer(engine, long_from=len(long_prompt))
            ends: list[float] = []

            async def until_end(stream):
                out = await _tokens(stream)
                ends.append(loop.time())
                return out

            async def first_token(stream):
                async for ev in stream:
                    return loop.time(), [ev.token_id] + (await _tokens(stream))[0]

            held = [asyncio.create_task(until_end(engine.add_request(prompt_ids[i], _greedy(120))))
                    for i in background]
            await asyncio.sleep(0.3)  # both decoding, one on each device
            seats = sorted(w.name for w in engine.router.placements.values())
            long = asyncio.create_task(until_end(engine.add_request(long_prompt, _greedy(120))))
            await asyncio.sleep(0.05)
            waited = engine.router.num_pending
            first, tokens = await first_token(engine.add_request(prompt_ids[short], _greedy()))
            results = [await t for t in held] + [await long]
            await _wait_pools_whole(engine)
            return seats, waited, first, min(ends), tokens, results, list(engine.router.role_changes), \
                engine.pool_stats()
        finally:
            engine.stop()

    seats, waited, first, first_end, tokens, results, changes, stats = asyncio.run(main())
    assert seats == ["cpu:0", "cpu:1"] and waited == 0
    assert [(c.device, c.role) for c in changes][:2] == [("cpu:0", "prefill"), ("cpu:0", "adaptive")]
    assert first < first_end  # the short prompt went before any decode ended
    assert tokens == hf_greedy[short]
    assert [r[0][:32] for r in results[:2]] == [hf_greedy[i] for i in background]
    assert all(r[1] == "length" for r in results) and all(s.whole for s in stats)


@pytest.mark.slow
def test_a_device_given_back_on_the_role_tick_takes_decodes_and_their_tokens_stay_exact(loaded_fp32, prompt_ids,
                                                                                        hf_greedy):
    """A long prompt dedicates cpu:0; every short request that arrives meanwhile decodes on cpu:1. With no other
    request arriving or ending, the role tick (Engine._role_tick) gives cpu:0 back once the demand fades and moves
    about half of cpu:1's decodes to it, live, mid-generation: the moved requests' tokens are still
    transformers', and every page comes back."""
    cfg = config_from_dict({"model": {"dtype": "float32"}, "devices": {"mode": "adaptive",
                                                                        "devices": ["cpu:0", "cpu:1"]},
                            "kv": {"memory_gib": 0.25, "page_size": 16}, "scheduler": {"max_num_batched_tokens": 48}})
    long_prompt = (prompt_ids[6] * 40)[:400]
    short = [i for i, p in enumerate(prompt_ids) if len(p) < len(long_prompt)][:6]

    async def main():
        engine = Engine(cfg, loaded_fp32)
        engine.start(asyncio.get_running_loop())
        try:
            _install_placer(engine, long_from=len(long_prompt))
            long = engine.add_request(long_prompt, _greedy(4))
            await asyncio.sleep(0.05)
            streams = {i: engine.add_request(prompt_ids[i], _greedy(160)) for i in short}
            await asyncio.sleep(0.1)
            seats = sorted(w.name for w in engine.router.placements.values())
            results = {i: await _tokens(s) for i, s in streams.items()}
            await _tokens(long)
            await _wait_pools_whole(engine)
            return seats, results, list(engine.router.role_changes), engine.router.num_migrations["moved"], \
                engine.pool_stats()
        finally:
            engine.stop()

    seats, results, changes, num_moved, stats = asyncio.run(main())
    assert seats == ["cpu:1"] * (len(short) + 1)  # the long one decodes there too
    assert [(c.device, c.role) for c in changes][:2] == [("cpu:0", "prefill"), ("cpu:0", "adaptive")]
    assert num_moved >= len(short) // 2 - 1
    assert [results[i][0][:len(hf_greedy[i])] for i in short] == [hf_greedy[i] for i in short]
    assert all(s.whole for s in stats)


@pytest.mark.slow
def test_a_follow_up_turn_whose_prefix_is_cached_is_not_a_long_prompt(loaded_fp32):
    """A 400-token prompt is long (a device is dedicated to it); the next turn of that conversation, the same 400
    tokens and its answer plus a few new ones, finds all but its last pages cached and is not: no demand, no
    dedication, no decodes moved. Judged by its whole length, it dedicated a device to prefill the few tokens it had
    left and moved that device's decodes away."""
    cfg = config_from_dict({"model": {"dtype": "float32"}, "devices": {"mode": "adaptive",
                                                                        "devices": ["cpu:0", "cpu:1"]},
                            "kv": {"memory_gib": 0.25, "page_size": 16}, "scheduler": {"max_num_batched_tokens": 48}})
    first_turn = [(7 * i) % 2000 + 100 for i in range(400)]

    async def main():
        engine = Engine(cfg, loaded_fp32)
        engine.start(asyncio.get_running_loop())
        try:
            placer = _install_placer(engine, long_from=200)
            answer, _ = await _tokens(engine.add_request(first_turn, _greedy(8)))
            await asyncio.sleep(1.0)  # the demand fades and the role tick gives the device back
            before = list(engine.router.role_changes), placer.policy.last_long
            stream = engine.add_request(first_turn + answer + [300, 301, 302, 303], _greedy(8))
            tokens, _ = await _tokens(stream)
            after = list(engine.router.role_changes), placer.policy.last_long
            await _wait_pools_whole(engine)
            return before, after, stream.request.num_cached_tokens, tokens, engine.pool_stats()
        finally:
            engine.stop()

    before, after, num_cached, tokens, stats = asyncio.run(main())
    roles = [(c.device, c.role) for c in before[0]]
    assert [r for _, r in roles] == ["prefill", "adaptive"]  # the first turn was long; its device came back
    assert num_cached >= 400 and len(tokens) == 8  # the follow-up reused its prefix ...
    assert after == before  # ... and was not long: no demand, no role change
    assert all(s.whole for s in stats)
