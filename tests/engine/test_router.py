"""Router: admission, decode seats and pages, device choice; on stub workers, no model and no threads."""

from __future__ import annotations

from nodeserve.engine.router import Router
from nodeserve.engine.worker import WorkerLimits
from nodeserve.kv.manager import KVManager
from nodeserve.request import Request
from nodeserve.sampling_params import SamplingParams


class StubWorker:
    """What the router reads and calls on a worker."""

    def __init__(self, name: str, num_pages: int, max_num_seqs: int = 64):
        self.name = name
        self.kv = KVManager(num_pages, 16)
        self.limits = WorkerLimits(max_num_seqs, 1024, 8192)
        self.num_assigned = 0
        self.num_outstanding_prefill_tokens = 0
        self.prefills: list[Request] = []

    def assign(self, req: Request) -> None:
        self.num_assigned += 1

    def add_prefill(self, req: Request) -> None:
        self.num_outstanding_prefill_tokens += req.num_prompt_tokens
        self.prefills.append(req)

    def finish(self, req: Request) -> None:
        """What the worker holding a finished request does: free its decode reservation."""
        self.kv.free(req.pages)
        self.num_assigned -= 1


def _req(rid: str, num_prompt_tokens: int, max_tokens: int = 16) -> Request:
    return Request(rid, [1] * num_prompt_tokens, SamplingParams(max_tokens=max_tokens))


def test_a_decode_device_takes_no_more_requests_than_it_can_batch():
    """Short prompts prefilled on their decode device (local_prefill_threshold) must not starve behind handoffs:
    a decode device is assigned at most max_num_seqs requests, so its batch always has a seat for them."""
    prefill, decode = StubWorker("cpu:0", 100), StubWorker("cpu:1", 100, max_num_seqs=2)
    router = Router([prefill], [decode], local_prefill_threshold=64, max_waiting=8, max_queued_tokens=10_000)
    longs = [_req(f"long{i}", 100) for i in range(3)]
    short = _req("short", 10)
    for r in longs + [short]:
        router.admit(r)
    assert decode.num_assigned == 2 and router.num_pending == 2
    assert prefill.prefills == longs[:2] and decode.prefills == []
    decode.finish(longs[0])
    router.dispatch()
    assert decode.num_assigned == 2 and prefill.prefills == longs and router.num_pending == 1
    decode.finish(longs[1])
    router.dispatch()
    assert decode.num_assigned == 2 and decode.prefills == [short] and router.num_pending == 0
