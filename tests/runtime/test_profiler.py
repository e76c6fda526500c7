"""The start-up profile and SLO admission on the real model: measured, refined online, wired into the router."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from nodeserve.core.admission import SloMiss
from nodeserve.core.cost_model import StepShape
from nodeserve.config import config_from_dict
from nodeserve.runtime.engine import Engine
from nodeserve.core.sampling_params import SamplingParams


def _config(profile: bool = True, **slo):
    return config_from_dict({"model": {"dtype": "float32", "quantization": "none"},
                             "devices": {"mode": "disaggregated", "prefill": ["cpu:0"], "decode": ["cpu:1"]},
                             "kv": {"memory_gib": 0.25}, "scheduler": {"max_num_batched_tokens": 128},
                             "profile": {"startup": profile, "budget_s": 2.0}, "slo": slo})


def _run(config, loaded, body):
    async def main():
        engine = Engine(config, loaded)
        engine.start(asyncio.get_running_loop())
        try:
            await asyncio.get_running_loop().run_in_executor(None, engine.warmup)
            result = await body(engine)
            for _ in range(200):
                if all(s.whole for s in engine.pool_stats()):
                    return result
                await asyncio.sleep(0.05)
            pytest.fail(f"KV pages leaked: {engine.pool_stats()}")
        finally:
            engine.stop()
    return asyncio.run(main())


async def _drain(stream) -> int:
    n = 0
    async for ev in stream:
        n += ev.token_id is not None
    return n


def test_profile_measures_every_device_and_refines_online(loaded_fp32):
    async def body(engine: Engine):
        model = engine.profiler.model
        for name in ("cpu:0", "cpu:1"):
            m = model.devices[name]
            assert len(m.profile_samples) >= 6
            # Any positive time for a real step, and more for more work.
            small, big = StepShape.of([(16, 0)]), StepShape.of([(128, 0)])
            assert 0 < m.step_time(small) < m.step_time(big)
        assert model.copy_bandwidth[("cpu:0", "cpu:1")] > 1e8  # a memcpy: well over 100 MB/s
        assert model.kv_bytes_per_token == 30 * 2 * 3 * 64 * 4  # SmolLM2 float32: layers x K,V x heads x dim x 4 B
        before = len(model.devices["cpu:1"].online_samples)
        ids = list(range(1000, 1040))
        stream = engine.add_request(ids, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        assert await _drain(stream) == 8
        assert stream.request.predicted_ttft is not None  # admission "off" still predicts, for the metric
        engine.profiler.refine()
        online = list(model.devices["cpu:1"].online_samples)
        assert len(online) >= before + 6  # one record per decode step
        # Each carries what the step attended: one row of a 40-token prompt at positions 40..46.
        contexts = [f[4] for f, _ in online[before:] if f[3] == 1]
        assert contexts and all(40 <= c <= 46 for c in contexts)
        return True
    assert _run(_config(), loaded_fp32, body)


def test_steps_that_verified_guesses_are_not_fitted_online(loaded_fp32):
    async def body(engine: Engine):
        decoder = next(w for w in engine.profiler.workers if w.name == "cpu:1")
        model = engine.profiler.model.devices["cpu:1"]
        before, seen = len(model.online_samples), time.monotonic()
        ids = list(range(1000, 1012)) * 4  # a repeating prompt: prompt lookup finds guesses at every step
        stream = engine.add_request(ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        assert await _drain(stream) == 12
        engine.profiler.refine()
        guessed = [r for r in decoder.records.since(seen) if r.num_guess_rows]
        assert guessed and all(r.num_decodes == 1 + r.num_guess_rows for r in guessed)  # one stream's rows
        # one stream: a plain decode step has one row; a verify step's rows must not enter the fit as decodes
        assert all(f[3] <= 1 for f, _ in list(model.online_samples)[before:])
        return True
    config = _config()
    config = dataclasses.replace(config, speculative=dataclasses.replace(config.speculative, method="prompt_lookup",
                                                                          adaptive=False))
    assert _run(config, loaded_fp32, body)


def test_admission_rejects_a_request_whose_predicted_ttft_misses(loaded_fp32):
    async def body(engine: Engine):
        with pytest.raises(SloMiss, match="predicted time to first token"):
            engine.add_request(list(range(1000, 1100)), SamplingParams(max_tokens=4, temperature=0))
        assert not engine.streams and engine.num_pending == 0
        return True
    # 1 ms cannot hold a 100-token prefill on a CPU core.
    assert _run(_config(admission="reject", ttft_s=0.001, margin=0.0), loaded_fp32, body)


def test_admission_admits_what_meets_the_slo(loaded_fp32):
    async def body(engine: Engine):
        stream = engine.add_request(list(range(1000, 1020)), SamplingParams(max_tokens=4, temperature=0,
                                                                            ignore_eos=True))
        return await _drain(stream)
    # Targets any CPU meets, busy or not (the default TPOT target, 100 ms, is missed by float32 decode steps on a
    # core shared with other work: 128 ms beside a soak).
    assert _run(_config(admission="reject", ttft_s=30.0, tpot_s=10.0), loaded_fp32, body) == 4


def test_profile_off_installs_no_admission(loaded_fp32):
    async def body(engine: Engine):
        assert engine.router.admission is None
        assert not engine.profiler.model.devices["cpu:0"].samples
        return True
    assert _run(_config(profile=False), loaded_fp32, body)
