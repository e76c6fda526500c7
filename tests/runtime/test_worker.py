"""Worker's step on a fake runner: no model, no thread (the test turns the loop by hand)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from nodeserve.device import make_device
from nodeserve.sampling.sampler import Sampler
from nodeserve.core.handoff import STOP_PAGES, MigrationOutcome
from nodeserve.core.scheduler import FORWARD_FAILED, Batch, Handoff, Seq, chunk_of
from nodeserve.runtime.worker import Arrival, FreePages, Migrate, Role, Worker, WorkerLimits
from nodeserve.kv.manager import KVManager
from nodeserve.core.request import Request, TokenEvent
from nodeserve.core.sampling_params import SamplingParams

VOCAB, POISON = 32, 31


class FakeRunner:
    """Greedy picks last token + 1; a chunk holding POISON raises. Records every step's chunks."""

    def __init__(self, num_pages: int):
        self.pool = SimpleNamespace(manager=KVManager(num_pages, 16), page_size=16, window=None, window_layers=frozenset())
        self.steps: list[list[tuple[int, int]]] = []  # per run: (start_pos, num_tokens) per chunk

    def run(self, chunks, on_layer_done=None, before_layer=None) -> torch.Tensor:
        self.steps.append([(c.start_pos, len(c.token_ids)) for c in chunks])
        if any(POISON in c.token_ids for c in chunks):
            raise RuntimeError("injected fault")
        rows = [torch.nn.functional.one_hot(torch.tensor((c.token_ids[-1] + 1) % VOCAB), VOCAB).float() * 10
                for c in chunks if c.want_logits]
        return torch.stack(rows) if rows else torch.zeros(0, VOCAB)


def _worker(max_num_seqs: int = 8, max_num_batched_tokens: int = 16, num_pages: int = 32):
    events: list[tuple[Request, TokenEvent]] = []
    released: list[Request] = []  # what the worker reported as given back
    runner = FakeRunner(num_pages)
    worker = Worker(make_device("cpu:0"), Role.COLOCATED, runner, Sampler(torch.device("cpu")), frozenset(),
                    WorkerLimits(max_num_seqs, max_num_batched_tokens, 1024), events.extend, released.extend)
    return worker, runner, events, released


def _admit(worker: Worker, prompt: list[int], max_tokens: int) -> Request:
    """What the router does for a request prefilled on its decode device."""
    req = Request(f"r{len(prompt)}-{prompt[0]}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    worker.add_prefill(req, worker.kv.allocate(worker.kv.pages_for(req.max_total_tokens)))
    return req


def _turn(worker: Worker) -> None:
    worker._drain_inbox(block=False)
    worker._finish(worker.scheduler.drop_aborted())
    worker._advance_migrations()
    worker._step()


def test_a_long_prompt_is_chunked_then_decodes_and_gives_every_page_back():
    worker, runner, events, released = _worker()
    req = _admit(worker, [1 + i % 20 for i in range(40)], max_tokens=3)  # ends with token 20
    for _ in range(5):
        _turn(worker)
    assert runner.steps == [[(0, 16)], [(16, 16)], [(32, 8)], [(40, 1)], [(41, 1)]]
    assert [ev.token_id for _, ev in events] == [21, 22, 23]
    assert events[-1][1].finish_reason == "length" and req.finished
    assert worker.kv.num_used == 0 and released == [req] and not worker.scheduler.running


def test_short_prefills_share_a_step_with_decodes_within_the_seats():
    worker, runner, events, released = _worker(max_num_seqs=2)
    first = _admit(worker, [1, 2, 3], max_tokens=10)
    _turn(worker)  # first's prefill
    second = _admit(worker, [5, 6], max_tokens=10)
    _turn(worker)
    assert runner.steps[-1] == [(3, 1), (0, 2)]  # first decodes while second prefills
    assert [s.req for s in worker.scheduler.running] == [first, second]


def test_a_fault_in_one_request_fails_only_that_request():
    worker, runner, events, released = _worker()
    good = _admit(worker, [1, 2, 3], max_tokens=4)
    bad = _admit(worker, [4, POISON], max_tokens=4)
    _turn(worker)  # the batch fails; each is re-run alone
    assert runner.steps == [[(0, 3), (0, 2)], [(0, 3)], [(0, 2)]]
    ends = {req.request_id: ev for req, ev in events if ev.finish_reason is not None}
    assert ends[bad.request_id].finish_reason == "error" and ends[bad.request_id].error == FORWARD_FAILED  # never the raw text
    for _ in range(3):
        _turn(worker)
    assert [ev.token_id for req, ev in events if req is good] == [4, 5, 6, 7]
    assert worker.kv.num_used == 0 and set(released) == {good, bad}
    assert worker.num_batch_failures == 1  # counted (nodeserve:batch_failures_total) and logged, never silent


def test_an_aborted_request_gives_its_pages_back_at_the_next_turn():
    worker, runner, events, released = _worker()
    req = _admit(worker, [1, 2, 3], max_tokens=50)
    _turn(worker)
    _turn(worker)
    assert worker.kv.num_used > 0
    req.aborted = True
    _turn(worker)
    assert worker.kv.num_used == 0 and not worker.scheduler.running and req.finished and released == [req]


def test_an_arrival_decodes_after_its_copies_or_if_it_ended_meanwhile_frees_its_pages_after_a_host_wait():
    worker, runner, events, released = _worker()
    calls = []
    worker.device = SimpleNamespace(name="cpu:0", wait_event=lambda e: calls.append(("wait", e)),
                                    synchronize_event=lambda e: calls.append(("sync", e)), record_event=lambda: None)
    arrived, aborted, failed = (Request(rid, [1, 2, 3], SamplingParams(max_tokens=4, temperature=0), output_ids=[4],
                                        num_computed_tokens=3) for rid in ("ok", "gone", "bad"))  # as prefilled
    aborted.aborted = True
    for req, event, error in ((arrived, "e1", None), (aborted, "e2", None), (failed, "e3", "copy failed")):
        worker.send(Arrival(req, worker.kv.allocate(1), 0, event, error))
    worker._drain_inbox(block=False)
    # The request that is still wanted decodes once its stream waited on the copies (no host wait); the two
    # others give their pages back only after the host waited on theirs: they may be reserved again at once.
    assert calls == [("wait", "e1"), ("sync", "e2"), ("sync", "e3")]
    assert [s.req for s in worker.scheduler.running] == [arrived] and arrived.num_computed_tokens == 3
    assert released == [aborted, failed] and worker.kv.num_used == 1
    assert [(r, ev.finish_reason, ev.error) for r, ev in events] == [(failed, "error", "copy failed")]
    _turn(worker)
    assert runner.steps[-1] == [(3, 1)] and [ev.token_id for r, ev in events if r is arrived] == [5]


def test_a_remote_prefill_copies_each_page_the_decode_device_lacks_once_and_never_one_it_has_cached():
    """The decode device holds the first 6 pages (its prefix cache), this device none: every chunk is computed
    here, but only pages 6 and 7 are copied, the partly written one again with the chunk that fills it."""
    worker, runner, events, released = _worker(max_num_batched_tokens=40)
    copies: list[tuple[list[int], list[int]]] = []

    class Transfer:
        def page_indices(self, src, dst, ids):
            copies.append((list(src), list(dst)))

    target = SimpleNamespace(name="cpu:9")
    worker.transfers[target.name] = Transfer()
    req = Request("r", list(range(1, 121)), SamplingParams(max_tokens=4))  # 7 full pages of 16 and 8 tokens
    seq = Seq(req, list(range(8)), Handoff(target, list(range(100, 108)), num_cached_pages=6))
    chunks = []
    while req.num_computed_tokens < 120:
        n = min(40, 120 - req.num_computed_tokens)
        batch = Batch([seq], [chunk_of(seq, n)], 0)
        plan = worker._copy_plan(batch, [0])
        worker._layer_hook(plan)
        plan.commit([0])
        chunks.append(n)
        req.num_computed_tokens += n
    assert chunks == [40, 40, 40]
    # tokens 80..119 write pages 5 (cached there), 6 and 7: only 6 and 7 go.
    assert copies == [([6, 7], [106, 107])] and seq.handoff.num_copied_pages == 2


class RecordingTransfer:
    """Records a worker's transfer calls; after_copies runs its callback at once (the copies are 'issued')."""

    def __init__(self, jobs):
        self.jobs = jobs

    def page_indices(self, src, dst, ids):
        return (list(src), list(dst), ids)

    def copy_layer(self, layer, pages):
        self.jobs.append(("copy", layer, pages))

    def after_copies(self, on_done):
        self.jobs.append(("after",))
        self.on_done = on_done

    def finish(self, request_id, src, on_done, num_copied_pages=0, num_cached_pages=0):
        self.jobs.append(("finish", request_id, list(src), num_copied_pages))


class Target:
    name = "cpu:1"

    def __init__(self):
        self.sent = []

    def send(self, msg):
        self.sent.append(msg)


def _migrating_worker():
    worker, runner, events, released = _worker(num_pages=64)
    worker.pool = SimpleNamespace(layers=[0, 1, 2], num_layers=3, page_size=16, window_layers=frozenset())
    jobs, outcomes = [], []
    worker._on_migrated = lambda req, outcome, downtime, pages: outcomes.append((req.request_id, outcome))
    target = Target()
    worker.transfers[target.name] = transfer = RecordingTransfer(jobs)
    return worker, runner, target, transfer, jobs, outcomes


def test_a_live_migration_precopies_full_pages_while_decoding_then_stops_for_the_last_few():
    worker, runner, target, transfer, jobs, outcomes = _migrating_worker()
    req = _admit(worker, [1 + i % 20 for i in range(60)], max_tokens=40)
    for _ in range(5):  # prefill (16-token chunks), then a decode step: 61 tokens of KV, on 4 pages
        _turn(worker)
    seq = worker.scheduler.running[0]
    pages = list(seq.page_table)
    worker.send(Migrate(req, Handoff(target, list(range(100, 110)))))
    _turn(worker)
    # Round 1: the 3 full pages, every layer, while the request stays in the batch and keeps decoding.
    assert jobs[:4] == [("copy", layer, (pages[:3], [100, 101, 102], (req.request_id,))) for layer in range(3)] \
        + [("after",)]
    assert worker.scheduler.running == [seq] and runner.steps[-1] == [(61, 1)]
    _turn(worker)
    assert len(jobs) == 4  # the round is still copying: nothing more is sent
    transfer.on_done(None)  # its copies ran
    _turn(worker)
    # 63 tokens of KV: 1 page left (the partial one) <= STOP_PAGES: it leaves the batch, the rest goes, then the
    # handoff frees its pages here.
    assert 1 <= STOP_PAGES and worker.scheduler.running == []
    assert jobs[4:] == [("copy", layer, (pages[3:4], [103], (req.request_id,))) for layer in range(3)] \
        + [("finish", req.request_id, pages, 4)]
    assert outcomes == [] and not req.finished  # MOVED is said by the target when it resumes


def test_a_migration_of_a_request_not_running_here_or_that_ends_gives_the_target_pages_back():
    worker, runner, target, transfer, jobs, outcomes = _migrating_worker()
    gone = Request("gone", [1], SamplingParams(max_tokens=2))
    worker.send(Migrate(gone, Handoff(target, [102])))  # its KV still on its way here
    req = _admit(worker, [1 + i % 20 for i in range(40)], max_tokens=5)
    for _ in range(4):
        _turn(worker)
    worker.send(Migrate(req, Handoff(target, [100, 101, 102, 103])))
    for _ in range(3):  # round 1 starts and is never done; the request ends (max_tokens) before the move
        _turn(worker)
    assert [(type(m), m.pages) for m in target.sent] == [(FreePages, [102])]
    assert outcomes == [("gone", MigrationOutcome.NOT_RUNNING), (req.request_id, MigrationOutcome.FINISHED)]
    assert req.finished and jobs[-1][0] == "finish"  # the target frees its pages when the handoff lands


def test_a_stop_and_copy_migration_moves_at_once():
    worker, runner, target, transfer, jobs, outcomes = _migrating_worker()
    req = _admit(worker, [1 + i % 20 for i in range(40)], max_tokens=20)
    for _ in range(4):
        _turn(worker)
    pages = list(worker.scheduler.running[0].page_table)
    worker.send(Migrate(req, Handoff(target, [100, 101, 102, 103]), live=False))
    _turn(worker)
    assert worker.scheduler.running == [] and [j[0] for j in jobs] == ["copy"] * 3 + ["finish"]
    assert jobs[0][2][0] == pages[:3]


def test_a_failed_batch_does_not_count_its_pages_as_sent_so_the_solo_retry_sends_them():
    """Race: the copy plan advanced a handoff's counters when the hook was built, before the forward ran; after a
    failed batch the solo retry then sent nothing, and the decode device attended over stale KV."""
    worker, runner, target, transfer, jobs, outcomes = _migrating_worker()
    run = runner.run

    def run_with_layers(chunks, on_layer_done=None, before_layer=None):
        logits = run(chunks, on_layer_done)  # raises on POISON before any layer is done
        for layer in range(3):
            if on_layer_done is not None:
                on_layer_done(layer)
        return logits

    runner.run = run_with_layers
    remote = Request("remote", list(range(1, 13)), SamplingParams(max_tokens=4, temperature=0))
    table = worker.kv.allocate(1)
    worker.add_prefill(remote, table, Handoff(target, [100, 101]))
    _admit(worker, [4, POISON], max_tokens=4)
    _turn(worker)  # the batch (all of `remote`'s prompt + the poisoned one) fails; each runs again alone
    assert runner.steps == [[(0, 12), (0, 2)], [(0, 12)], [(0, 2)]]
    copies = [j for j in jobs if j[0] == "copy"]
    assert copies == [("copy", layer, ([table[0]], [100], ("remote",))) for layer in range(3)]
    assert jobs[-1] == ("finish", "remote", table, 1)  # handed off with its one (partial) page copied once


def test_a_request_whose_sampling_raises_fails_alone():
    """An exception in the batched sampler failed every request on the device (fail_all); now the rows are sampled
    one by one and only the one that raises ends, with a message that names sampling."""
    from nodeserve.core.scheduler import SAMPLING_FAILED

    worker, runner, events, released = _worker()
    sample = worker.sampler.__call__

    class Picky:  # raises for any batch holding a request seeded 13
        def __call__(self, logits, params, *args):
            if any(p.seed == 13 for p in params):
                raise RuntimeError("injected sampling fault")
            return sample(logits, params, *args)

        def request_generator(self, *args):
            return None

    worker.sampler = Picky()
    good = _admit(worker, [1, 2, 3], max_tokens=3)
    bad = Request("bad", [5, 6], SamplingParams(max_tokens=3, temperature=0, seed=13))
    worker.add_prefill(bad, worker.kv.allocate(worker.kv.pages_for(bad.max_total_tokens)))
    for _ in range(4):
        _turn(worker)
    assert [ev.token_id for r, ev in events if r is good] == [4, 5, 6]
    ends = {r.request_id: ev for r, ev in events if ev.finish_reason is not None}
    assert ends["bad"].finish_reason == "error" and ends["bad"].error == SAMPLING_FAILED
    assert ends[good.request_id].finish_reason == "length" and worker.kv.num_used == 0


def test_a_device_that_fails_every_request_step_after_step_is_taken_for_dead():
    """A sticky device error (illegal address, ECC on CUDA; injected here) left the worker alive, failing
    everything, while /health said ready and the watchdog kept being fed. After MAX_FAILED_STEPS steps in which
    every request failed the device is dead: `dead` (so /health's dead_threads), the watchdog's check fails naming
    it, later requests fail at once, and every page still comes back."""
    from nodeserve.runtime.worker import MAX_FAILED_STEPS
    from nodeserve.server.systemd import workers_healthy

    worker, runner, events, released = _worker()
    calls = []

    def sticky(chunks, on_layer_done=None, before_layer=None):
        calls.append(len(chunks))
        raise RuntimeError("CUDA error: an illegal memory access")

    runner.run = sticky
    check = workers_healthy([worker], max_stall=60.0)
    reqs = []
    for _ in range(MAX_FAILED_STEPS):
        assert not worker.dead and check()
        reqs.append(_admit(worker, [1, 2, 3], max_tokens=4))
        _turn(worker)
    assert worker.dead and "illegal memory access" in worker.failure
    assert not check() and "device failed" in check.last_reason
    num_calls = len(calls)
    late = _admit(worker, [4, 5], max_tokens=4)
    _turn(worker)
    ends = {r.request_id: ev for r, ev in events if ev.finish_reason is not None}
    assert len(calls) == num_calls  # a dead device runs nothing more
    assert ends[late.request_id].error == "device cpu:0 failed (the error is in the server log)"
    assert worker.kv.num_used == 0 and set(released) == set(reqs) | {late}


def test_one_failing_request_among_good_ones_does_not_kill_the_device():
    from nodeserve.runtime.worker import MAX_FAILED_STEPS

    worker, runner, events, released = _worker()
    for i in range(MAX_FAILED_STEPS + 2):
        _admit(worker, [7 + i, POISON], max_tokens=2)  # fails
        _admit(worker, [1 + i, 2], max_tokens=2)       # and a good one beside it
        _turn(worker)
    assert not worker.dead and worker.num_failed_steps == 0
