"""Warm-up before READY: compile FlashInfer's kernels, capture the decode graphs and check the grammar mask on the
device (plain torch ops: nothing to compile, its kernels load now), so no request pays for them.

FlashInfer JIT-compiles each kernel at first use (cached in ~/.cache/flashinfer) and CUDA graphs are captured
once per bucket. On CPU devices there is nothing to warm: a no-op. FP8 pools must have their scales before
this runs (Engine.warmup calibrates them first): a captured graph keeps the scales it was captured with.
"""

from __future__ import annotations

import logging
import time

import torch

from nodeserve.core.scheduler import SeqChunk
from nodeserve.kv.reservation import scratch_pages, scratch_windows
from nodeserve.runtime.model_runner import ModelRunner
from nodeserve.sampling.constrain import warm_masks

log = logging.getLogger(__name__)

WARMUP_PROMPT_TOKENS = 16


def warmup_runner(runner: ModelRunner) -> None:
    """One prefill chunk and one decode step on a throwaway sequence, then the graph captures."""
    if runner.device.type != "cuda":
        return
    start = time.monotonic()
    num_tokens = WARMUP_PROMPT_TOKENS
    kv = runner.pool.manager
    spans = [(0, num_tokens), (num_tokens, num_tokens + 1)]
    with scratch_pages(kv, kv.pages_for(num_tokens + 1)) as pages, torch.cuda.device(runner.device), \
            scratch_windows(runner.pool.window, spans) as windows:
        runner.run([SeqChunk([0] * num_tokens, 0, pages, window_table=windows[0])])  # prefill kernels
        runner.run([SeqChunk([0], num_tokens, pages, window_table=windows[1])])      # decode kernels (eager)
        if runner.graphs is not None:
            runner.graphs.capture()
        try:
            warm_masks(runner.device, runner.model.cfg.vocab_size)
        except Exception:  # logged for the operator; structured output's requests still try it
            log.warning("%s: warming up the grammar mask failed", runner.device, exc_info=True)
        torch.cuda.synchronize(runner.device)
    log.info("%s: warmed up in %.1fs", runner.device, time.monotonic() - start)
