"""core/start.py: the role and step limits each device starts with."""

from __future__ import annotations

from nodeserve.config import config_from_dict
from nodeserve.core.load import Role
from nodeserve.core.start import decode_prefill_chunk, start_plan, start_roles


def _config(devices: dict, scheduler: dict | None = None):
    return config_from_dict({"devices": devices, "scheduler": scheduler or {}}, check_devices=False)


def test_disaggregated_devices_start_as_prefill_then_decode():
    cfg = _config({"mode": "disaggregated", "prefill": ["cpu:0"], "decode": ["cpu:1", "cpu:2"]})
    assert start_roles(cfg) == [("cpu:0", Role.PREFILL), ("cpu:1", Role.DECODE), ("cpu:2", Role.DECODE)]


def test_colocated_and_adaptive_devices_all_start_in_that_role():
    assert start_roles(_config({"mode": "colocated", "devices": ["cpu:0", "cpu:1"]})) == \
        [("cpu:0", Role.COLOCATED), ("cpu:1", Role.COLOCATED)]
    assert start_roles(_config({"mode": "adaptive", "devices": ["cpu:0", "cpu:1"]})) == \
        [("cpu:0", Role.ADAPTIVE), ("cpu:1", Role.ADAPTIVE)]


def test_a_decode_device_and_an_adaptive_one_cap_their_prompt_tokens_beside_decodes():
    cfg = _config({"mode": "disaggregated", "prefill": ["cpu:0"], "decode": ["cpu:1", "cuda:0"]},
                  {"max_num_seqs": 8, "max_num_batched_tokens": 512})
    plan = start_plan(cfg, max_model_len=4096)
    assert [(s.name, s.limits.max_prefill_with_decodes) for s in plan] == [("cpu:0", 0), ("cpu:1", 32),
                                                                           ("cuda:0", 256)]
    assert all((s.limits.max_num_seqs, s.limits.max_num_batched_tokens, s.limits.max_model_len) == (8, 512, 4096)
               for s in plan)
    colocated = start_plan(_config({"mode": "colocated", "devices": ["cpu:0"]}), 4096)
    assert colocated[0].limits.max_prefill_with_decodes == 0
    # adaptive: for while another device prefills for it (the router switches the cap: test_router)
    adaptive = start_plan(_config({"mode": "adaptive", "devices": ["cpu:0", "cpu:1"]}), 4096)
    assert [s.limits.max_prefill_with_decodes for s in adaptive] == [32, 32]


def test_a_set_decode_prefill_chunk_wins_over_the_device_default():
    cfg = _config({"mode": "disaggregated", "prefill": ["cpu:0"], "decode": ["cpu:1"]}, {"decode_prefill_chunk": 100})
    assert decode_prefill_chunk(cfg.scheduler, "cpu") == 100 == start_plan(cfg, 2048)[1].limits.max_prefill_with_decodes
