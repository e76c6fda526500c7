"""Measures the cost model: a short profile of every device at start-up, refined online from its step records.

The profile runs a fixed list of prefill chunks and decode batches on each device (all devices at once, each in
a thread set up as its worker's is, so a CPU core is measured alone on its core while its neighbour works too,
as when serving), cheapest first, until a time budget runs out. KV content does not matter for timing: the
steps read pages they never wrote. Online, every step a worker records (its prefill tokens and attended pairs,
its decode rows and the tokens they attend) becomes a sample.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Sequence

import torch

from nodeserve.core.cost_model import CostModel, LinearKernels, StepModel, StepShape
from nodeserve.core.scheduler import SeqChunk
from nodeserve.kv.manager import OutOfPages
from nodeserve.kv.reservation import scratch_pages, scratch_windows
from nodeserve.model.block_quant import gemv_rows

if TYPE_CHECKING:
    from nodeserve.runtime.worker import Worker

log = logging.getLogger(__name__)

# (prefill chunks as (tokens, cached tokens), decode contexts), cheapest first. The first MIN_STEPS always run
# (each of the seven features moves on its own among them, so the fit is determined however slow the device:
# decode batches of one and two row passes, a small prefill in passes, GEMM prefills of two lengths and one after
# a prefix long enough that attention is a third of its time: a prefix of 448 left the per-pair cost to noise and
# the fit put chunks of 400-1,000 tokens after as many cached up to 28 % short); the rest while the budget lasts.
PROFILE_STEPS: tuple[tuple[tuple[tuple[int, int], ...], tuple[int, ...]], ...] = (
    ((), (64,)),
    (((16, 0),), ()),
    ((), (64,) * 8),
    ((), (512,) * 8),
    ((), (128,) * 16),
    (((64, 0),), ()),
    (((64, 1984),), ()),
    (((128, 0),), ()),
    (((32, 0),), (128,) * 8),
    ((), (128,) * 32),
    ((), (1024,) * 4),
    ((), (256,) * 12),
    (((256, 0),), ()),
)
MIN_STEPS = 8
WARMUP_STEP = (((4, 0),), (16,))  # untimed: the first prefill and decode pay for lazy initialisation
COPY_BYTES = 16 * 2**20


def profile_runner(worker: Worker, budget_s: float, steps=PROFILE_STEPS) -> list[tuple[StepShape, float]]:
    """Runs `steps` on the worker's runner, in the calling thread: the first MIN_STEPS, then more until budget_s
    is spent; (shape, seconds) each. Steps that do not fit the batch limits or the free pages are skipped."""
    runner, kv, limits = worker.runner, worker.kv, worker.limits
    out: list[tuple[StepShape, float]] = []
    start = time.monotonic()
    for i, (chunks, decodes) in enumerate((WARMUP_STEP, *steps)):
        if i > MIN_STEPS and time.monotonic() - start > budget_s:
            break
        num_tokens = sum(n for n, _ in chunks) + len(decodes)
        if len(chunks) + len(decodes) > limits.max_num_seqs or num_tokens > limits.max_num_batched_tokens:
            continue
        lengths = [c + 1 for c in decodes] + [s + n for n, s in chunks]
        sizes = [kv.pages_for(n) for n in lengths]
        if max(lengths) > limits.max_model_len or not kv.can_allocate(sum(sizes)):
            continue
        spans = [(c, c + 1) for c in decodes] + [(s, s + n) for n, s in chunks]
        try:
            with scratch_windows(worker.window, spans) as windows, scratch_pages(kv, sum(sizes)) as pages:
                starts = [sum(sizes[:k]) for k in range(len(sizes))]
                tables = [pages[a:a + n] for a, n in zip(starts, sizes)]
                seqs = [SeqChunk([0] * (end - start), start, t, window_table=w)
                        for (start, end), t, w in zip(spans, tables, windows)]
                t0 = time.perf_counter()
                runner.run(seqs)
                worker.device.synchronize_event(worker.device.record_event())
                elapsed = time.perf_counter() - t0
        except OutOfPages:  # too few window pages free for this shape
            continue
        if i > 0:
            out.append((StepShape.of(chunks, decodes), elapsed))
    return out


def copy_bandwidth(src: Worker, dst: Worker, num_bytes: int = COPY_BYTES) -> float:
    """Bytes/s of one num_bytes copy from src's device to dst's, best of three."""
    a = torch.ones(num_bytes, dtype=torch.uint8, device=src.pool.device)
    b = torch.empty(num_bytes, dtype=torch.uint8, device=dst.pool.device)
    b.copy_(a)  # first touch: pages mapped, peer access enabled
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        b.copy_(a)
        dst.device.synchronize_event(dst.device.record_event())
        best = min(best, time.perf_counter() - t0)
    return num_bytes / best


class Profiler:
    """Owns the engine's CostModel: measure() once before serving, refine() whenever a fresher fit is wanted
    (cheap: a least-squares fit over at most a thousand samples per device)."""

    def __init__(self, workers: Sequence[Worker]):
        self.workers = list(workers)
        pool = self.workers[0].pool
        num_layers = pool.num_layers
        self.model = CostModel({w.name: StepModel(kernels=LinearKernels(*gemv_rows(w.runner.model)))
                                for w in self.workers}, {},
                               pool.bytes_per_page_per_layer * num_layers // pool.page_size, num_layers)
        self._seen = {w.name: time.monotonic() for w in self.workers}  # records ending after this are new
        self._lock = threading.Lock()  # refine() runs on the event loop; measure() in the warm-up thread

    def measure(self, budget_s: float) -> None:
        """The start-up profile: every device at once, each for at most ~budget_s, then copy bandwidths."""
        start = time.monotonic()
        results: dict[str, list[tuple[StepShape, float]]] = {}

        def run(w: Worker) -> None:
            w.device.init_worker_thread()
            try:
                results[w.name] = profile_runner(w, budget_s)
            except Exception:  # a profile is an optimisation: serve without it rather than not at all
                log.exception("%s: start-up profile failed", w.name)

        threads = [threading.Thread(target=run, args=(w,), name=f"profile {w.name}", daemon=True)
                   for w in self.workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        bandwidth = {(a.name, b.name): copy_bandwidth(a, b) for a in self.workers for b in self.workers if a is not b}
        with self._lock:
            self.model.copy_bandwidth.update(bandwidth)
            for w in self.workers:
                m = self.model.devices[w.name]
                for shape, seconds in results.get(w.name, []):
                    m.add(shape, seconds)
                m.refit()
            self._seen = {w.name: time.monotonic() for w in self.workers}  # the profile's own steps left no records
        for w in self.workers:
            m = self.model.devices[w.name]
            log.info("%s: profiled %d steps, fit error %s: %s", w.name, len(m.profile_samples),
                     "-" if m.rel_error is None else f"{m.rel_error:.0%}",
                     ", ".join(f"{k}={v:.3g}" for k, v in m.as_dict()["coefficients"].items()))
        log.info("start-up profile took %.1fs", time.monotonic() - start)

    def refine(self) -> None:
        """Adds the step records made since the last call to each device's samples and refits."""
        with self._lock:
            for w in self.workers:
                records = w.records.since(self._seen[w.name])
                if not records:
                    continue
                self._seen[w.name] = records[-1].end
                m = self.model.devices[w.name]
                for r in records:
                    # Not steps that verified guesses: their rows are one sequence's (its KV read once for all of
                    # them), mostly at one stream with the other core lent. Fitted as decode rows of as many
                    # streams, after bench/speculative.py's repetition prompts they priced a decode row at 0.30 ms
                    # (and 3.35 a pass of 8) where plain steps' fits say 1.6-1.9 ms (SmolLM2, Zen 4), and the
                    # 32-stream burst after them was priced by that.
                    if r.num_guess_rows:
                        continue
                    m.add(StepShape(r.num_prefill_tokens, r.prefill_pairs, r.num_decodes, r.decode_context),
                          r.end - r.start, online=True)
                m.refit()

    def as_dict(self) -> dict:
        with self._lock:
            return self.model.as_dict()
