"""Turns one engine request's token events into text pieces: incremental detokenization, stop strings,
logprob entries and usage counts. Shared by the chat and completions routes, streamed or not."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator

from nodeserve.runtime.engine import Engine, RequestStream
from nodeserve.tokenizer import IncrementalDetokenizer, Tokenizer

if TYPE_CHECKING:
    from nodeserve.metrics import Metrics

log = logging.getLogger(__name__)


class GenerationError(Exception):
    """The engine failed this request (a fault in its forward); the message is safe to show."""


@dataclass
class Piece:
    text: str
    logprobs: list[tuple[str, float, list[tuple[str, float]]]] = field(default_factory=list)
    finish_reason: str | None = None


class Generation:
    """One choice: iterate `pieces()`; afterwards num_completion_tokens holds the usage count."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, stream: RequestStream, stop: list[str],
                 want_logprobs: bool, metrics: Metrics | None = None):
        self.engine, self.tokenizer, self.stream, self.metrics = engine, tokenizer, stream, metrics
        self.token_times: list[float] = []
        self.finish_reason = "abort"  # until the engine says otherwise: a client that leaves aborts
        self.stop = stop
        self.want_logprobs = want_logprobs
        self.detok = IncrementalDetokenizer(tokenizer, stream.request.prompt_ids)
        self.num_completion_tokens = 0
        self.num_prompt_tokens = stream.request.num_prompt_tokens
        # Text that might be the start of a stop string is held back until it can't be.
        self._held = ""
        self._hold = max((len(s) for s in stop), default=1) - 1

    async def pieces(self) -> AsyncIterator[Piece]:
        try:
            async for piece in self._pieces():
                yield piece
        finally:
            self._observe()

    def _observe(self) -> None:
        req = self.stream.request
        start, end = req.prefill_start, req.prefill_end
        first = self.token_times[0] if self.token_times else None
        sources = ", ".join(f"{k} {v}" for k, v in req.cached_from.items())
        log.info("request %s: %d prompt tokens, %d cached%s, %d generated, %s, ttft %s", req.request_id,
                 self.num_prompt_tokens, req.num_cached_tokens, f" ({sources})" if sources else "",
                 self.num_completion_tokens, self.finish_reason,
                 f"{first - req.arrival_time:.3f}s" if first is not None else "-")
        if self.metrics is None:
            return
        self.metrics.observe_request(
            prompt_tokens=self.num_prompt_tokens, completion_tokens=self.num_completion_tokens,
            finish_reason=self.finish_reason, arrival=req.arrival_time, first_token=first,
            finished=time.monotonic(), token_times=self.token_times,
            queue_time=start - req.arrival_time if start is not None else None,
            prefill_time=end - start if start is not None and end is not None else None,
            decode_time=time.monotonic() - first if first is not None else None,
            predicted_ttft=req.predicted_ttft)

    async def _pieces(self) -> AsyncIterator[Piece]:
        pending_lp: list[tuple[str, float, list[tuple[str, float]]]] = []
        async for event in self.stream:
            if event.error is not None:
                self.finish_reason = "error"
                raise GenerationError(event.error)
            text = ""
            if event.token_id is not None:
                self.token_times.append(time.monotonic())
                self.num_completion_tokens += 1
                if self.metrics is not None:
                    self.metrics.observe_tokens(self.num_prompt_tokens if self.num_completion_tokens == 1 else 0, 1)
                text = self.detok.add(event.token_id)
                if self.want_logprobs and event.logprob is not None:
                    pending_lp.append((self.tokenizer.token_text(event.token_id), event.logprob,
                                       [(self.tokenizer.token_text(t), lp) for t, lp in event.top_logprobs or []]))
            finish = event.finish_reason
            if finish is not None:
                self.finish_reason = finish
            if finish is not None and finish != "abort":
                text += self.detok.flush()
            out, stopped = self._apply_stop(text, final=finish is not None)
            if stopped:
                self.finish_reason = "stop"
                self.engine.abort(self.stream, reason="stop")
                yield Piece(out, pending_lp, "stop")
                return
            if out or finish is not None:
                yield Piece(out, pending_lp, finish)
                pending_lp = []
            if finish is not None:
                return

    def _apply_stop(self, text: str, final: bool) -> tuple[str, bool]:
        if not self.stop:
            return text, False
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self.stop) if i >= 0]
        if hits:
            self._held = ""
            return buf[:min(hits)], True
        if final:
            self._held = ""
            return buf, False
        cut = max(len(buf) - self._hold, 0)
        self._held = buf[cut:]
        return buf[:cut], False
