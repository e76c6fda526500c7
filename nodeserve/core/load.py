"""What the policy sees: device roles, a device's load at one moment, the step limits and the SLO target.

Every placement, role and admission decision is made on these snapshots, never on a worker: the engine's
router builds them from live workers (runtime/loads.py), the simulator from its virtual devices (plan/simulate.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


# Of slo.tpot_s: the inter-token gap a decode device's side work may stretch its steps to. The rest of the target
# is margin for what no model predicts (a step's noise, a lent core's return, the event loop).
GAP_SHARE = 0.6


class Role(enum.StrEnum):
    """What a device does. The only definition: workers, placers and the simulator share it."""

    PREFILL = "prefill"      # prefills for decode devices, decodes nothing
    DECODE = "decode"        # decodes what prefill devices send; prefills only what local_prefill_threshold keeps
    COLOCATED = "colocated"  # prefills what it decodes
    ADAPTIVE = "adaptive"    # decodes, prefills what it decodes, and may prefill for another device


@dataclass(frozen=True)
class DeviceLoad:
    """One device as the router sees it at this moment."""

    name: str
    role: Role
    queued_prefill_tokens: int = 0   # prompt tokens placed here and not yet prefilled
    num_decodes: int = 0             # requests in its decode batch
    decode_context: int = 0          # tokens those requests attend, in total
    free_seats: int = 1              # decode seats left (max_num_seqs - requests placed here for decode)
    prefill_share: float = 0.0       # share of its recent time spent in steps with prefill chunks (0..1)
    free_tokens: float = float("inf")  # KV tokens it can still reserve
    num_incoming: int = 0            # requests with a decode seat here, not decoding yet (their prefill is ahead)
    incoming_context: int = 0        # their prompt tokens, in total
    cached_tokens: int = 0           # the placed request's prompt tokens this device's prefix cache holds
    queued_prompts: tuple[int, ...] = ()  # prompt tokens left of each prompt waiting in its scheduler
    caps_prefill: bool = False       # its prompt tokens beside decodes are capped (core/side_prefill.py)


@dataclass(frozen=True)
class StepLimits:
    max_num_batched_tokens: int
    max_num_seqs: int


@dataclass(frozen=True)
class SloTarget:
    ttft_s: float
    tpot_s: float
    ttft_per_token_s: float = 0.0

    def ttft_limit(self, num_prompt_tokens: int) -> float:
        return self.ttft_s + self.ttft_per_token_s * num_prompt_tokens

    @property
    def max_side_step_s(self) -> float:
        """The longest step that what a decode device takes on besides its decodes (its own prompts' tokens,
        speculation's guesses, its core lent between steps) may make: GAP_SHARE of the TPOT target."""
        return GAP_SHARE * self.tpot_s
