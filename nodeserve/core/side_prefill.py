"""How many prompt tokens a disaggregated decode device adds to a step of its decodes (its own short prompts,
devices.local_prefill_*): as many as the device's own step model predicts keep the step within its streams' gap
budget. A fixed chunk is a constant tuned on one CPU: 32 tokens added ~20 ms to a step beside 15 streams on a
Zen 5 with bf16 prompt rows, while 32 rows of SmolLM2's projections take ~70 ms on one core with the AVX2 int16
kernels (the sum of bench/kernels.py --r16-gemm's shapes, AVX2 forced on a Zen 4). Sized by the model (the start-up
profile's, refitted online), the same setting holds the inter-token gap on a slow core and a fast one, and uses
the slack a light batch leaves. The engine's decode workers and the simulator's use the same policy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from nodeserve.core.cost_model import StepModel, StepShape

MIN_TOKENS = 8           # a local prompt always moves: a batch already past the budget still takes this many
MAX_FIT_ERROR = 0.3      # a model off by more (a profile taken on a starved core) is not used: the fixed chunk is


def usable(model: StepModel | None) -> bool:
    """Whether a step model predicts well enough to size work by (fitted, within MAX_FIT_ERROR of its samples)."""
    return model is not None and model.rel_error is not None and model.rel_error <= MAX_FIT_ERROR


@dataclass
class SidePrefill:
    step_model: Callable[[], StepModel | None]  # the device's model as it stands (None: not measured)
    max_step_s: float      # the longest step its prompt tokens may make (SloTarget.max_side_step_s)
    fallback: int          # prompt tokens a step takes when there is no usable model (the fixed chunk)

    def tokens(self, decode_contexts: Sequence[float], num_cached: int, most: int) -> int:
        """Prompt tokens (at most `most`) a step of decodes attending `decode_contexts` tokens may add, for a
        prompt with num_cached tokens computed: the most whose predicted step fits max_step_s, at least
        MIN_TOKENS."""
        model = self.step_model()
        if model is None or not usable(model) or self.max_step_s <= 0:
            return min(self.fallback, most)

        def fits(n: int) -> bool:
            return model.step_time(StepShape.of([(n, num_cached)], decode_contexts)) <= self.max_step_s

        lo, hi = min(MIN_TOKENS, most), most
        if fits(hi):
            return hi
        while hi - lo > 1:  # the predicted time grows with n (coefficients >= 0) but for the switch to a GEMM
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo
