"""The periodic stats line in the log (as vLLM prints one): token throughput, requests running and waiting
(the router's admission queue included), KV usage per device and the KV transfer rate since the last line."""

from __future__ import annotations

import asyncio
import logging
import time

from nodeserve.metrics import PREFIX, Metrics

log = logging.getLogger("nodeserve.stats")


class StatsLine:
    def __init__(self, metrics: Metrics, engine):
        self.metrics, self.engine = metrics, engine
        self._last = (time.monotonic(), self._counters())

    def _counters(self) -> tuple[float, float, float]:
        labels = {"model_name": self.metrics.model_name}
        get = self.metrics.registry.get_sample_value
        return tuple(get(PREFIX + name, labels) or 0.0
                     for name in ("prompt_tokens_total", "generation_tokens_total", "kv_transfer_bytes_sum"))

    def line(self) -> str:
        now, counters = time.monotonic(), self._counters()
        (then, before), self._last = self._last, (now, counters)
        dt = max(now - then, 1e-9)
        prompt, generation, transfer = ((a - b) / dt for a, b in zip(counters, before))
        stats = self.engine.pool_stats()
        running = sum(s.num_running for s in stats)
        waiting = sum(s.num_waiting for s in stats) + self.engine.num_pending
        kv = ", ".join(f"{s.device} {100 * (1 - s.num_free / max(s.num_pages, 1)):.0f}%" for s in stats)
        # Per tier: pages held of pages it can hold, and prompt tokens it served (cumulative).
        tiers = "".join(f", {t.tier} {t.num_used}/{t.num_pages} pages {t.num_hit_tokens} hit tok"
                        for t in self.engine.tier_stats() if t.tier != "device")
        return (f"stats: prompt {prompt:.1f} tok/s, generation {generation:.1f} tok/s, running {running}, "
                f"waiting {waiting}, KV used {kv}{tiers}, transfer {transfer / 1e6:.1f} MB/s")


async def stats_loop(stats: StatsLine, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        log.info(stats.line())
