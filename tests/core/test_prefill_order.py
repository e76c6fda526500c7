"""Deadline prefill order (Moore-Hodgson) on a cost model of 1 ms a prompt token: prompts that can still meet
their TTFT go first, the longest of those that would make another late are set aside, nobody starves."""

from __future__ import annotations

from nodeserve.core.cost_model import CostModel, StepModel
from nodeserve.core.load import SloTarget, StepLimits
from nodeserve.core.prefill_order import MAX_WAIT_FACTOR, DeadlineOrder
from nodeserve.core.request import Request
from nodeserve.core.sampling_params import SamplingParams
from nodeserve.core.scheduler import Scheduler, Seq, WorkerLimits
from nodeserve.kv.manager import KVManager

SLO = SloTarget(ttft_s=2.5, tpot_s=0.1)
LIMITS = StepLimits(max_num_batched_tokens=1024, max_num_seqs=64)
COST = CostModel({"d": StepModel(coef=[0.0, 0.001, 0.0, 0.0, 0.0])})  # 1 ms a prompt token, nothing else


def _seq(name: str, num_tokens: int, arrival: float, computed: int = 0) -> Seq:
    req = Request(name, [1] * num_tokens, SamplingParams(max_tokens=8), arrival_time=arrival)
    req.num_computed_tokens = computed
    return Seq(req, [])


def _order(now: float = 0.0, device: str = "d") -> DeadlineOrder:
    return DeadlineOrder(device, SLO, LIMITS, lambda: COST, lambda: now)


def _names(groups) -> list[str]:
    """Both groups in order, the set-aside ones after a "|"."""
    first, later = groups
    return [s.req.request_id for s in first] + (["|"] + [s.req.request_id for s in later] if later else [])


def test_fifo_while_every_deadline_can_be_met():
    waiting = [_seq("a", 800, 0.0), _seq("b", 700, 0.1), _seq("c", 900, 0.2)]  # 2.4 s in all, due at 2.5 s +
    assert _names(_order()(waiting)) == ["a", "b", "c"]


def test_the_longest_prompt_that_would_make_others_late_is_set_aside():
    # FIFO: long (2.9 s, due 2.5) misses, and every prompt behind it too. Walking the EDF order: long alone is
    # late (set aside); x ends at 1.5 (due 2.6); y at 3.2 (due 2.7): the longer of x and y, y, is set aside; z
    # ends at 2.1 (due 2.8). Three on time would need 3.8 s by 2.8: two is the most, and these two end soonest.
    waiting = [_seq("long", 2900, 0.0), _seq("x", 1500, 0.1), _seq("y", 1700, 0.2), _seq("z", 600, 0.3)]
    assert _names(_order()(waiting)) == ["x", "z", "|", "long", "y"]


def test_what_is_left_to_prefill_counts_not_the_whole_prompt():
    # 2,900 tokens with 2,000 done: 0.9 s left, on time (1.9 s); the new 2,000-token prompt would then end at
    # 3.9 s, due 3.0: set aside.
    waiting = [_seq("started", 2900, 0.0, computed=2000), _seq("new", 2000, 0.5)]
    assert _names(_order(now=1.0)(waiting)) == ["started", "|", "new"]
    # ... not done yet: 2.9 s left from t=1 misses its 2.5 s deadline; the new one alone makes it.
    waiting = [_seq("fresh", 2900, 0.0), _seq("new", 2000, 0.5)]
    assert _names(_order(now=0.1)(waiting)) == ["new", "|", "fresh"]


def test_a_prompt_waiting_past_the_limit_goes_first_whatever_its_chances():
    old = _seq("old", 3000, 0.0)
    waiting = [old, _seq("new", 100, 9.0)]
    assert _names(_order(now=9.0)(waiting)) == ["new", "|", "old"]  # hopeless, set aside
    late = MAX_WAIT_FACTOR * SLO.ttft_s + 0.1
    assert _names(_order(now=late)(waiting)) == ["old", "new"]


def test_no_cost_model_for_the_device_keeps_the_waiting_order():
    waiting = [_seq("long", 2900, 0.0), _seq("x", 100, 0.1)]
    assert _names(_order(device="other")(waiting)) == ["long", "x"]


def test_the_scheduler_fills_its_budget_in_that_order():
    s = Scheduler(KVManager(16, 4), WorkerLimits(4, 2048, 4096), frozenset())
    s.order = _order()
    for seq in (_seq("long", 2900, 0.0), _seq("x", 1500, 0.1), _seq("z", 600, 0.3)):
        s.waiting.append(seq)
    batch = s.schedule()
    # x and z first (2,100 tokens > the 2,048 budget: z gets what x leaves); the set-aside long one gets nothing.
    assert [(seq.req.request_id, len(c.token_ids)) for seq, c in zip(batch.seqs, batch.chunks)] == \
        [("x", 1500), ("z", 548)]


def test_set_aside_prompts_run_only_in_steps_without_a_kept_one():
    s = Scheduler(KVManager(16, 4), WorkerLimits(4, 2048, 4096), frozenset())
    s.order = _order()
    for seq in (_seq("long", 2900, 0.0), _seq("x", 100, 0.1)):
        s.waiting.append(seq)
    assert [seq.req.request_id for seq in s.schedule().seqs] == ["x"]  # not x + 1,948 of long's tokens
    s.waiting[1].ready = False  # x waits for its pages to be read: long runs meanwhile
    assert [seq.req.request_id for seq in s.schedule().seqs] == ["long"]
