"""Scheduler: batches, chunks, seats, and what postprocess does with each outcome; no model, no threads."""

from __future__ import annotations

from nodeserve.core.handoff import Handoff, Migration
from nodeserve.core.scheduler import FORWARD_FAILED, Scheduler, Seq, WorkerLimits
from nodeserve.kv.manager import KVManager
from nodeserve.core.request import Request, TokenEvent
from nodeserve.core.sampling_params import SamplingParams

EOS = 0


def _scheduler(max_num_seqs=4, max_num_batched_tokens=16, num_pages=16) -> Scheduler:
    return Scheduler(KVManager(num_pages, 4), WorkerLimits(max_num_seqs, max_num_batched_tokens, 64), frozenset({EOS}))


def _local(s: Scheduler, num_prompt_tokens: int, max_tokens: int = 8) -> Seq:
    """A request prefilled and decoded here, on the pages the router reserved."""
    req = Request(f"r{len(s.waiting)}", list(range(1, num_prompt_tokens + 1)), SamplingParams(max_tokens=max_tokens))
    seq = Seq(req, s.kv.allocate(s.kv.pages_for(req.max_total_tokens)))
    s.waiting.append(seq)
    return seq


def _step(s: Scheduler, tokens: dict[str, int], now: float = 1.0):
    """Schedules one step and feeds each sequence that samples the token given for it (default 7)."""
    batch = s.schedule()
    outcomes = [TokenEvent(tokens.get(seq.req.request_id, 7)) if c.want_logits else None
                for seq, c in zip(batch.seqs, batch.chunks)]
    return batch, s.postprocess(batch, outcomes, now)


def test_a_long_prompt_is_chunked_within_the_budget_and_then_decodes():
    s = _scheduler()
    seq = _local(s, 40)
    sizes = []
    for _ in range(4):
        batch, out = _step(s, {})
        sizes.append([len(c.token_ids) for c in batch.chunks])
    assert sizes == [[16], [16], [8], [1]]
    assert seq.req.output_ids == [7, 7] and s.running == [seq]
    assert seq.req.num_computed_tokens == 41 and seq.req.prefill_end == 1.0


def test_a_decoding_batch_takes_at_most_max_prefill_with_decodes_prompt_tokens_a_step():
    s = Scheduler(KVManager(16, 4), WorkerLimits(4, 16, 64, max_prefill_with_decodes=3), frozenset({EOS}))
    a = _local(s, 10)
    batch, _ = _step(s, {})
    assert [len(c.token_ids) for c in batch.chunks] == [10]        # nothing decoding yet: the whole budget
    _local(s, 10)
    sizes = [[len(c.token_ids) for c in _step(s, {})[0].chunks] for _ in range(4)]
    assert sizes == [[1, 3], [1, 3], [1, 3], [1, 1]]                # beside a's decode: 3 prompt tokens a step
    assert a.req.num_computed_tokens == 14
    s.caps_prefill_with_decodes = False  # an adaptive device with no prefill device beside it: no cap
    _local(s, 10)
    assert [len(c.token_ids) for c in _step(s, {})[0].chunks] == [1, 1, 10]


def test_decodes_go_first_and_prefills_share_what_the_budget_leaves():
    s = _scheduler(max_num_batched_tokens=8)
    a = _local(s, 3)
    _step(s, {})
    b, c = _local(s, 20), _local(s, 2)
    batch, _ = _step(s, {})
    assert batch.seqs == [a, b] and [len(c.token_ids) for c in batch.chunks] == [1, 7] and batch.num_decodes == 1
    assert [ch.want_logits for ch in batch.chunks] == [True, False]
    batch, _ = _step(s, {})
    assert batch.seqs == [a, b] and [len(c.token_ids) for c in batch.chunks] == [1, 7]  # nothing left for c this step
    batch, _ = _step(s, {})
    assert batch.seqs == [a, b, c] and [len(c.token_ids) for c in batch.chunks] == [1, 6, 1]  # b's last chunk, then c's first token
    assert [ch.want_logits for ch in batch.chunks] == [True, True, False]


def test_a_stop_token_or_max_tokens_ends_a_request_and_frees_its_pages():
    s = _scheduler()
    stops, runs_out = _local(s, 3), _local(s, 3, max_tokens=2)
    _step(s, {})
    _, out = _step(s, {"r0": EOS})
    assert [(r.request_id, e.finish_reason) for r, e in out.events] == [("r0", "stop"), ("r1", "length")]
    assert out.released == [stops.req, runs_out.req] and s.idle and s.kv.num_used == 0
    assert stops.req.finished and runs_out.req.output_ids == [7, 7]


def test_a_failed_sequence_ends_alone_with_a_safe_message():
    s = _scheduler()
    good, bad = _local(s, 3), _local(s, 3)
    batch = s.schedule()
    out = s.postprocess(batch, [TokenEvent(5), RuntimeError("secret details")], 1.0)
    assert out.events[1] == (bad.req, TokenEvent(None, finish_reason="error", error=FORWARD_FAILED))
    assert out.released == [bad.req] and s.running == [good] and s.kv.num_used == s.kv.pages_for(10)


def test_a_remote_prefill_runs_on_the_pages_placed_for_it_and_is_handed_off_after_its_first_token():
    s = _scheduler(num_pages=8)
    reqs = [Request(f"p{i}", list(range(1, 9)), SamplingParams(max_tokens=4)) for i in range(2)]
    seqs = [Seq(r, s.kv.allocate(2), Handoff(target="decode device", pages=[9, 10, 11, 12])) for r in reqs]
    s.waiting.extend(seqs)
    batch, out = _step(s, {})
    assert batch.seqs == seqs and out.handoffs == seqs and not s.running and not s.waiting
    assert s.kv.num_used == 4  # freed by the worker once the transfer has read them, not here


def test_a_request_ending_while_it_migrates_hands_its_target_pages_to_the_transfer():
    s = _scheduler()
    seq = _local(s, 3, max_tokens=2)
    _step(s, {})
    seq.migration = Migration(Handoff("d", [20, 21, 22]))
    _, out = _step(s, {})
    assert out.handoffs == [seq] and seq.handoff.pages == [20, 21, 22] and seq.migration is None
    assert out.migrations_ended == [seq] and out.released == [] and seq.req.finished


def test_aborts_and_failures_free_local_pages_and_hand_remote_ones_to_the_transfer():
    s = _scheduler()
    local, remote = _local(s, 3), Seq(Request("x", [1, 2], SamplingParams(max_tokens=8)), [], Handoff("d", [5]))
    s.waiting.append(remote)
    local.req.aborted = True
    out = s.drop_aborted()
    assert out.released == [local.req] and out.handoffs == [] and out.num_prompt_tokens_done == 3
    out = s.fail_all("worker died")
    assert out.handoffs == [remote] and remote.req.finished and out.events[0][1].error == "worker died"
    assert s.idle and s.kv.num_used == 0
