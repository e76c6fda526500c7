"""What each device is at start-up: its role and its step limits. The runtime builds what this decides
(runtime/node.py), and `nodeserve plan` simulates the same."""

from __future__ import annotations

from dataclasses import dataclass, replace

from nodeserve.config import Config, SchedulerSection
from nodeserve.core.load import Role
from nodeserve.core.scheduler import WorkerLimits

# scheduler.decode_prefill_chunk = 0 (auto), by device type: on CPU a 32-token chunk added ~60 ms to a decode step
# with the int16 prompt kernels (a 200-token prompt in one step stretched the inter-token gap p99 to 328 ms,
# bench/compare.py), ~20 ms beside 15 streams with bf16 prompts on the Zen 5; 64 and 128 there kept 91.7 / 93.8 %
# of a closed loop of 16 on time in one run each (91.7 % with 32) and raised the gap p99 to 110 / 138 ms (89 with
# 32; docs/performance.md). A GPU's steps absorb far more.
AUTO_DECODE_PREFILL_CHUNK = {"cpu": 32, "cuda": 256}


@dataclass(frozen=True)
class DeviceStart:
    name: str             # as configured: "cpu:0", "cuda:3"
    role: Role
    limits: WorkerLimits


def decode_prefill_chunk(scheduler: SchedulerSection, device_type: str) -> int:
    """Prompt tokens a decoding device's step may add (scheduler.decode_prefill_chunk, 0: by device type)."""
    return scheduler.decode_prefill_chunk or AUTO_DECODE_PREFILL_CHUNK.get(device_type, AUTO_DECODE_PREFILL_CHUNK["cpu"])


def start_roles(config: Config) -> list[tuple[str, Role]]:
    """Every device's role at start, prefill devices first: disaggregated, the prefill devices PREFILL and the
    others DECODE; otherwise every device ADAPTIVE (devices.mode = "adaptive") or COLOCATED."""
    if config.prefill_devices:
        decode_role = Role.DECODE
    else:
        decode_role = Role.ADAPTIVE if config.devices.mode == "adaptive" else Role.COLOCATED
    return [(n, Role.PREFILL) for n in config.prefill_devices] + [(n, decode_role) for n in config.decode_devices]


def start_plan(config: Config, max_model_len: int) -> list[DeviceStart]:
    """start_roles, with each device's step limits: the scheduler's, and on a disaggregated decode device (and an
    adaptive one, for while another device prefills for it) a cap on the prompt tokens a step beside its decodes
    may take (its own short prompts then slow its streams a little at a time)."""
    s = config.scheduler
    limits = WorkerLimits(s.max_num_seqs, s.max_num_batched_tokens, max_model_len)
    return [DeviceStart(name, role, replace(limits, max_prefill_with_decodes=decode_prefill_chunk(
                s, name.strip().lower().split(":")[0])) if role in (Role.DECODE, Role.ADAPTIVE) else limits)
            for name, role in start_roles(config)]
