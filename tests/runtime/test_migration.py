"""Moving a running request between devices on the real model: live (pre-copy rounds) and stop-and-copy give the
same tokens as a run that never moved, the request ends on the target, and every page on both devices comes back;
a move that cannot start or whose request ends first leaves nothing behind."""

from __future__ import annotations

import asyncio

import pytest

from nodeserve.config import config_from_dict
from nodeserve.runtime.engine import Engine
from tests.runtime.test_engine import _greedy, _tokens, _wait_pools_whole

CONFIG = {"model": {"dtype": "float32", "quantization": "none"}, "devices": {"mode": "colocated", "devices": ["cpu:0", "cpu:1"]},
          "kv": {"memory_gib": 0.25, "page_size": 16, "prefix_cache": False},
          "scheduler": {"max_num_batched_tokens": 64}}


async def _run_moving(engine: Engine, prompt: list[int], max_tokens: int, move_after: int | None, live: bool):
    """Greedy tokens of one request, moved to the other device after `move_after` tokens (None: never)."""
    stream = engine.add_request(prompt, _greedy(max_tokens))
    rid = stream.request.request_id
    source = engine.router.placements[rid].name
    out, finish, moved = [], None, False
    async for ev in stream:
        if ev.token_id is not None:
            out.append(ev.token_id)
        finish = ev.finish_reason
        if move_after is not None and len(out) == move_after and not moved:
            target = next(w.name for w in engine.decode_workers if w.name != source)
            moved = engine.migrate(rid, target, live)
            assert moved
    return out, finish, source


@pytest.mark.slow
def test_live_and_stop_and_copy_moves_keep_the_tokens_and_free_every_page(loaded_fp32, prompt_ids):
    prompt = (prompt_ids[0] * 20)[:150]  # 10 pages of context when it moves

    async def main():
        engine = Engine(config_from_dict(CONFIG), loaded_fp32)
        engine.start(asyncio.get_running_loop())
        try:
            base = await _run_moving(engine, prompt, 40, None, True)
            live = await _run_moving(engine, prompt, 40, 8, True)
            stop = await _run_moving(engine, prompt, 40, 8, False)
            await _wait_pools_whole(engine)
            return base, live, stop, dict(engine.router.num_migrations), list(engine.router.migration_downtimes)
        finally:
            engine.stop()

    base, live, stop, outcomes, downtimes = asyncio.run(main())
    assert base[0] == live[0] == stop[0] and len(base[0]) == 40 and base[1] == live[1] == stop[1] == "length"
    assert outcomes == {"moved": 2} and len(downtimes) == 2


def test_a_move_that_cannot_start_or_outlives_its_request_leaves_nothing_behind(loaded_fp32, prompt_ids):
    async def main():
        engine = Engine(config_from_dict(CONFIG), loaded_fp32)
        engine.start(asyncio.get_running_loop())
        try:
            assert not engine.migrate("no-such-request", "cpu:1")
            stream = engine.add_request(prompt_ids[1], _greedy(3))
            rid = stream.request.request_id
            source = engine.router.placements[rid].name
            assert not engine.migrate(rid, source)  # already there
            target = "cpu:1" if source == "cpu:0" else "cpu:0"
            assert engine.migrate(rid, target) and not engine.migrate(rid, target)  # one move at a time
            tokens, finish = await _tokens(stream)
            await _wait_pools_whole(engine)
            return tokens, finish, engine.router.num_seats_taken, engine.router.moving
        finally:
            engine.stop()

    tokens, finish, seats, moving = asyncio.run(main())
    assert len(tokens) == 3 and finish == "length"
    assert sum(seats.values()) == 0 and moving == {}


@pytest.mark.parametrize("live", [True, False])
def test_an_abort_while_moving_frees_both_devices(loaded_fp32, prompt_ids, live):
    async def main():
        engine = Engine(config_from_dict(CONFIG), loaded_fp32)
        engine.start(asyncio.get_running_loop())
        try:
            stream = engine.add_request((prompt_ids[2] * 20)[:200], _greedy(200))
            rid = stream.request.request_id
            async for ev in stream:
                if ev.token_id is not None:
                    source = engine.router.placements[rid].name
                    engine.migrate(rid, "cpu:1" if source == "cpu:0" else "cpu:0", live)
                    engine.abort(stream)
                    break
            await _wait_pools_whole(engine)
            return engine.router.num_seats_taken, engine.router.moving
        finally:
            engine.stop()

    seats, moving = asyncio.run(main())
    assert sum(seats.values()) == 0 and moving == {}
