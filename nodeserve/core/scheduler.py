"""Scheduler: one device's batching policy, with no threads and no model.

schedule() picks the next step: every running decode (up to max_num_seqs) plus prefill chunks, oldest prompt
first or in the order installed (core/prefill_order.py), within the token budget. The worker runs the step and
samples; postprocess() applies the outcome of each sequence, says which requests ended, and frees the pages of
those whose KV lives only here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from nodeserve.core.handoff import Handoff, Migration
from nodeserve.kv.manager import KVManager, hash_pages
from nodeserve.kv.window import WindowPages
from nodeserve.core.request import Request, TokenEvent
from nodeserve.core.side_prefill import SidePrefill
from nodeserve.core.speculation import SeqSpeculation, Speculator

FORWARD_FAILED = "the model's forward pass failed for this request (the error is in the server log)"
SAMPLING_FAILED = "sampling the next token failed for this request (the error is in the server log)"


class SamplingFailed(Exception):
    """A request's sampling raised (its own parameters or grammar); the others in its batch were sampled."""


class SamplingLimit(SamplingFailed):
    """A request's sampling went past a limit (its grammar's mask took too long); the message names the limit
    and goes to the client as it is."""


@dataclass
class WorkerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    # Prompt tokens a step may add to a batch that is decoding (0: up to max_num_batched_tokens). A disaggregated
    # decode device's own prefills (short prompts) then slow its streams' steps a little at a time; an adaptive
    # device's too, while another device prefills for it (Scheduler.caps_prefill_with_decodes).
    max_prefill_with_decodes: int = 0


@dataclass
class SeqChunk:
    """One sequence's share of a step: feed `token_ids` at positions [start_pos, start_pos + len)."""

    token_ids: Sequence[int]
    start_pos: int             # tokens of this sequence already in the pool (num_computed_tokens)
    page_table: Sequence[int]  # its pages in this pool, covering at least start_pos + len tokens
    want_logits: bool = True    # whether to return logits for the last token fed
    # decodes only: token_ids[1:] are guesses (core/speculation.py), each fed as a decode row of its own, with
    # logits for every row; their K/V count only as far as the verify step accepts them
    num_draft_tokens: int = 0
    # its windowed layers' pages (kv/window.py) where the pool keeps them apart: -1 for pages no query reads
    window_table: Sequence[int] | None = None
    # prompt tokens, however few: a prompt's last token alone (the rest cached, or a chunk boundary) still runs the
    # prompt rows' kernels, so its K/V and first token do not depend on how the prompt was chunked or cached
    is_prompt: bool = False

    @property
    def is_decode(self) -> bool:
        """Whether it runs as decode rows (one, or one per guess): a single token that is not a prompt's."""
        return self.num_draft_tokens > 0 or (len(self.token_ids) == 1 and not self.is_prompt)


class PageLoad(Protocol):
    """Pages a request's device fills from other devices or tiers before computing the rest (the runtime's
    prefix_fetch.PrefixLoad); the scheduler only waits for it to end."""

    @property
    def num_pages(self) -> int: ...


@dataclass(eq=False)
class Seq:
    """A request's life on one device: its pages in this device's pool (taken by the router when it placed the
    request) and, if its KV is bound for another device, where (handoff), or how its live move goes (migration)."""

    req: Request
    page_table: list[int]
    handoff: Handoff | None = None
    migration: Migration | None = None
    num_published: int = -1  # its pages below this are in the prefix cache (-1: those it found there)
    load: PageLoad | None = None  # pages being filled from other devices or tiers first, or None
    ready: bool = True       # False until the load knows how many pages it fills (not scheduled until then)
    window: WindowPages | None = None  # its windowed layers' pages here (kv/window.py), if the pool has them
    speculation: SeqSpeculation | None = None  # its acceptance rate and drafter state here, once it speculates


@dataclass
class Batch:
    seqs: list[Seq]          # decodes first, then prefill chunks
    chunks: list[SeqChunk]   # what each feeds this step
    num_decodes: int


def chunk_of(seq: Seq, num_tokens: int, drafts: Sequence[int] = ()) -> SeqChunk:
    """What `seq` feeds in a step of num_tokens tokens (a decode: 1, and its guesses); its window pages (if any)
    advance to that step."""
    req, c = seq.req, seq.req.num_computed_tokens
    ids = req.prompt_ids[c:c + num_tokens] if c < req.num_prompt_tokens else [req.output_ids[-1], *drafts]
    if seq.window is not None:
        seq.window.advance(c, c + len(ids))
    return SeqChunk(ids, c, seq.page_table, want_logits=c + num_tokens >= req.num_prompt_tokens,
                    window_table=seq.window.table if seq.window is not None else None,
                    num_draft_tokens=len(ids) - 1 if c >= req.num_prompt_tokens else 0,
                    is_prompt=c < req.num_prompt_tokens)


@dataclass
class StepOutput:
    events: list[tuple[Request, TokenEvent]] = field(default_factory=list)
    handoffs: list[Seq] = field(default_factory=list)      # prefilled (or ended) here, KV bound elsewhere
    released: list[Request] = field(default_factory=list)  # ended here, every page given back
    migrations_ended: list[Seq] = field(default_factory=list)  # ended while moving to another device
    num_prompt_tokens_done: int = 0                        # prompt tokens prefilled or dropped


class Scheduler:
    def __init__(self, kv: KVManager, limits: WorkerLimits, eos_token_ids: frozenset[int],
                 free: Callable[[list[int]], None] | None = None):
        """free(pages): how pages of ended requests are given back (the worker's records an event first)."""
        self.kv, self.limits, self.eos_token_ids = kv, limits, eos_token_ids
        self.free = free or kv.free
        self.waiting: deque[Seq] = deque()  # prompts to prefill here, oldest first
        self.running: list[Seq] = []        # decoding here
        # Which waiting prompt goes first (core/prefill_order.py): order(waiting, running) -> (the prompts to run
        # first, in order; the rest, for steps with none of the first); None: oldest first.
        self.order: Callable[[Sequence[Seq], Sequence[Seq]], tuple[list[Seq], list[Seq]]] | None = None
        self.speculator: Speculator | None = None  # guesses for decodes to verify (core/speculation.py)
        # prompt tokens a step of decodes may add, by the device's step model (core/side_prefill.py); None: the
        # fixed limits.max_prefill_with_decodes
        self.side_prefill: SidePrefill | None = None
        # whether limits.max_prefill_with_decodes applies now (the router turns it off on an adaptive device
        # while no device is dedicated to prefill: runtime/router.py cap_prompts_beside_decodes)
        self.caps_prefill_with_decodes = True

    def use_side_prefill(self, side: SidePrefill) -> None:
        """Size the prompt tokens beside decodes by `side` (only where limits.max_prefill_with_decodes caps them)."""
        self.side_prefill = side

    def use_speculator(self, speculator: Speculator) -> None:
        self.speculator = speculator

    def use_order(self, order: Callable[[Sequence[Seq], Sequence[Seq]], tuple[list[Seq], list[Seq]]]) -> None:
        """The prefill order (core/prefill_order.py), once the cost model it predicts with is measured."""
        self.order = order

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    @property
    def has_work(self) -> bool:
        """Something schedule() can run: a decode, or a prompt not waiting for its pages to be read."""
        return bool(self.running) or any(s.ready for s in self.waiting)

    def schedule(self) -> Batch | None:
        decodes = self.running[:self.limits.max_num_seqs]
        budget = self.limits.max_num_batched_tokens - len(decodes)
        if decodes and self.limits.max_prefill_with_decodes and self.caps_prefill_with_decodes:
            cap = self.limits.max_prefill_with_decodes
            if self.side_prefill is not None:
                first = next((s for s in self.waiting if s.ready), None)
                cap = self.side_prefill.tokens([s.req.num_computed_tokens + 1 for s in decodes],
                                               first.req.num_computed_tokens if first is not None else 0, budget)
            budget = min(budget, cap)
        prefills: list[Seq] = []
        sizes: list[int] = []
        for group in self.order(self.waiting, decodes) if self.order is not None else (self.waiting,):
            for seq in group:
                if budget <= 0 or len(decodes) + len(prefills) >= self.limits.max_num_seqs:
                    break
                if not seq.ready:
                    continue
                n = min(seq.req.num_prompt_tokens - seq.req.num_computed_tokens, budget)
                prefills.append(seq)
                sizes.append(n)
                budget -= n
            if prefills:
                break
        if not decodes and not prefills:
            return None
        room = self.limits.max_num_batched_tokens - len(decodes) - sum(sizes)
        drafts: Sequence[Sequence[int]] = [()] * len(decodes)
        if self.speculator is not None and decodes and room > 0:
            drafts = self._drafts(self.speculator, decodes, prefills, sizes, room)
        return Batch(decodes + prefills, [chunk_of(s, 1, d) for s, d in zip(decodes, drafts)] +
                     [chunk_of(s, n) for s, n in zip(prefills, sizes)], len(decodes))

    def _drafts(self, speculator: Speculator, decodes: list[Seq], prefills: list[Seq], sizes: list[int],
                room: int) -> list[list[int]]:
        """The guesses each decode verifies this step, within the step's token budget and each request's limits:
        its max_tokens, the context, its pages. None where its KV is being moved or kept in window pages (both
        size what they hold by one token a step)."""
        page_size, limits, states = self.kv.page_size, [], []
        for seq in decodes:
            req = seq.req
            last = min(req.max_total_tokens, self.limits.max_model_len, len(seq.page_table) * page_size) - 1
            ok = seq.migration is None and seq.window is None and seq.load is None
            limits.append(max(0, last - req.num_computed_tokens) if ok else 0)
            if seq.speculation is None:
                seq.speculation = SeqSpeculation()
            states.append(seq.speculation)
        cached = [s.req.num_computed_tokens for s in prefills]
        return speculator.drafts(states, [s.req for s in decodes], limits, [s.req.num_computed_tokens for s in decodes],
                                 sum(sizes), sum(n * (c + n / 2) for n, c in zip(sizes, cached)), room)

    def postprocess(self, batch: Batch, outcomes: Sequence[TokenEvent | list[TokenEvent] | Exception | None],
                    now: float) -> StepOutput:
        """outcomes[i]: the token sampled for batch.seqs[i], None if it sampled nothing (a prompt's middle chunk),
        the tokens a verify step kept (a decode with guesses: the accepted guesses and the one after them), or
        the exception that failed it."""
        out = StepOutput()
        for i, (seq, chunk, outcome) in enumerate(zip(batch.seqs, batch.chunks, outcomes)):
            req, n = seq.req, len(chunk.token_ids)
            if isinstance(outcome, Exception):
                # The exception is in the server log; the client gets no raw exception text.
                error = str(outcome) if isinstance(outcome, SamplingLimit) else \
                    SAMPLING_FAILED if isinstance(outcome, SamplingFailed) else FORWARD_FAILED
                out.events.append((req, TokenEvent(None, finish_reason="error", error=error)))
                self._retire(seq, out)
                continue
            if i >= batch.num_decodes:  # the first chunk also settles what the cache spared
                out.num_prompt_tokens_done += n + (req.num_cached_tokens if chunk.start_pos == req.num_cached_tokens
                                                   else 0)
            if isinstance(outcome, list):
                self._verified(seq, chunk, outcome, out)
                continue
            req.num_computed_tokens += n
            self._publish(seq)
            if outcome is None:
                continue
            assert outcome.token_id is not None, "a sampled outcome carries its token"
            req.output_ids.append(outcome.token_id)
            outcome.finish_reason = self._finish_reason(req)
            out.events.append((req, outcome))
            first = len(req.output_ids) == 1
            if first:
                req.prefill_end = now
                self.waiting.remove(seq)
            if outcome.finish_reason is not None:
                self._retire(seq, out)
            elif first and seq.handoff is not None:
                out.handoffs.append(seq)
            elif first:
                self.start_decode(seq, now)
        return out

    def _verified(self, seq: Seq, chunk: SeqChunk, events: list[TokenEvent], out: StepOutput) -> None:
        """A verify step's outcome: event j's token came from the logits of the j-th token fed, which counted (its
        K/V stays) because every guess before it was accepted. The K/V of guesses past the kept ones is left in
        slots past num_computed_tokens: never published, and written over by the next step."""
        req, drafts = seq.req, chunk.token_ids[1:]
        num_accepted = 0
        while num_accepted < min(len(drafts), len(events)) and events[num_accepted].token_id == drafts[num_accepted]:
            num_accepted += 1
        if drafts and seq.speculation is not None:
            seq.speculation.observe(len(drafts), num_accepted)
            if self.speculator is not None:
                self.speculator.counts.add(len(drafts), num_accepted)
        ended = False
        for event in events:
            if event.token_id is None:
                raise ValueError("a verify step's kept tokens each carry their token id")
            req.num_computed_tokens += 1
            req.output_ids.append(event.token_id)
            event.finish_reason = self._finish_reason(req)
            out.events.append((req, event))
            if ended := event.finish_reason is not None:
                break
        self._publish(seq)
        if ended:
            self._retire(seq, out)

    def release_speculation(self, seq: Seq) -> None:
        """What its drafter holds for a request leaving this device (a draft model's pages)."""
        if seq.speculation is not None and self.speculator is not None:
            self.speculator.drafter.release(seq.speculation)

    def finish_reason(self, req: Request, token_id: int, num_output_tokens: int) -> str | None:
        """Why req ends if token_id is its output token number num_output_tokens (counting it), or None."""
        p = req.params
        if (token_id in self.eos_token_ids and not p.ignore_eos) or token_id in p.stop_token_ids:
            return "stop"
        if num_output_tokens >= req.max_tokens or req.num_prompt_tokens + num_output_tokens >= self.limits.max_model_len:
            return "length"
        return None

    def start_decode(self, seq: Seq, now: float) -> None:
        if seq.req.decode_start is None:
            seq.req.decode_start = now
        if seq.window is not None:  # prefilled here: one token a step from now on
            seq.window.shrink(seq.req.max_total_tokens)
        self.running.append(seq)
        self._publish(seq)

    def _publish(self, seq: Seq) -> None:
        """Enters this sequence's newly full pages into the prefix cache: their KV is written here, every token."""
        req, page_size = seq.req, self.kv.page_size
        num_full = min(req.num_computed_tokens // page_size, len(seq.page_table))
        if seq.num_published < 0:
            seq.num_published = req.num_cached_tokens // page_size
        if num_full <= seq.num_published or not self.kv.prefix_cache:
            return
        if len(req.page_hashes) < num_full:  # pages of generated tokens
            tokens = (req.prompt_ids + req.output_ids)[len(req.page_hashes) * page_size:num_full * page_size]
            req.page_hashes += hash_pages(tokens, page_size, req.page_hashes[-1] if req.page_hashes else None)
        first = seq.num_published
        parent = req.page_hashes[first - 1] if first else None  # for the KV events
        # The pages' tokens go with them: a later prompt matching their hashes is checked against them (scrub).
        token_ids = token_range(req, first * page_size, num_full * page_size)
        self.kv.publish(seq.page_table[first:num_full], req.page_hashes[first:num_full], parent, token_ids)
        if seq.window is not None:  # the window pages it still holds of them, for a later prompt's last window
            held = [(b, h) for b, h in zip(seq.window.table[first:num_full], req.page_hashes[first:num_full]) if b >= 0]
            seq.window.kv.manager.publish([b for b, _ in held], [h for _, h in held])
        seq.num_published = num_full

    def _finish_reason(self, req: Request) -> str | None:
        return self.finish_reason(req, req.output_ids[-1], len(req.output_ids))

    def _retire(self, seq: Seq, out: StepOutput) -> None:
        """Takes an ended request out of this device. Pages bound for another device go with the handoff, which
        frees both sides after the copies already queued for them."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
            req = seq.req  # what postprocess has not settled yet (it settles the cached part with the first chunk)
            settled = req.num_computed_tokens - (req.num_cached_tokens if req.num_computed_tokens == req.num_cached_tokens
                                                 else 0)
            out.num_prompt_tokens_done += req.num_prompt_tokens - settled
        seq.req.finished = True
        self.release_speculation(seq)
        if seq.migration is not None:  # moving: the target's pages are freed after the copies queued into them
            seq.handoff, seq.migration = seq.migration.handoff, None
            out.migrations_ended.append(seq)
        if seq.handoff is not None:
            out.handoffs.append(seq)
            return
        self.free(seq.page_table)
        seq.page_table = []
        if seq.window is not None:
            seq.window.release()
        out.released.append(seq.req)

    def drop_aborted(self) -> StepOutput:
        out = StepOutput()
        # One still loading is dropped once its load is done: its pages are being written until then.
        for seq in [s for s in [*self.running, *self.waiting] if s.req.aborted and s.load is None]:
            self._retire(seq, out)
        return out

    def fail_all(self, message: str) -> StepOutput:
        out = StepOutput()
        for seq in [*self.running, *self.waiting]:
            out.events.append((seq.req, TokenEvent(None, finish_reason="error", error=message)))
            self._retire(seq, out)
        return out


def token_range(req: Request, start: int, end: int) -> list[int]:
    """Tokens [start, end) of the prompt followed by the output, without copying the whole sequence."""
    num_prompt = len(req.prompt_ids)
    if end <= num_prompt:
        return req.prompt_ids[start:end]
    if start >= num_prompt:
        return req.output_ids[start - num_prompt:end - num_prompt]
    return req.prompt_ids[start:] + req.output_ids[:end - num_prompt]
