"""The static placer's conditional disaggregation: a short prompt prefills beside its decodes only while the
prefill devices are busy; long prompts, and short ones while a prefill device is free, go to a prefill device."""

from __future__ import annotations

from nodeserve.core.load import DeviceLoad
from nodeserve.core.placer import StaticPlacer
from nodeserve.core.request import Request
from nodeserve.core.sampling_params import SamplingParams


def _req(num_prompt_tokens: int) -> Request:
    return Request("r", [7] * num_prompt_tokens, SamplingParams(max_tokens=16))


def _loads(prefill_queued: int, decode_queued: int = 0) -> list[DeviceLoad]:
    return [DeviceLoad("cpu:0", "prefill", queued_prefill_tokens=prefill_queued),
            DeviceLoad("cpu:1", "decode", queued_prefill_tokens=decode_queued)]


def test_a_short_prompt_prefills_on_its_decode_device_only_while_the_prefill_device_is_busy():
    placer = StaticPlacer(local_prefill_when_busy=512)
    assert placer.place(0, _loads(0), _req(100)).prefill == "cpu:0"         # idle prefill device: disaggregated
    assert placer.place(0, _loads(300), _req(100)).prefill == "cpu:0"       # a short queue there: still
    assert placer.place(0, _loads(2000), _req(100)).prefill == "cpu:1"      # a long prompt ahead: here
    assert placer.place(0, _loads(2000), _req(600)).prefill == "cpu:0"      # not a short prompt
    assert placer.place(0, _loads(2000, 2500), _req(100)).prefill == "cpu:0"  # more queued here than there
    assert placer.num_busy_local == 1
    d = placer.place(0, _loads(2000), _req(100))
    assert (d.prefill, d.decode) == ("cpu:1", "cpu:1")


def test_off_by_default_and_the_plain_threshold_still_applies():
    placer = StaticPlacer()
    assert placer.place(0, _loads(5000), _req(100)).prefill == "cpu:0"
    assert StaticPlacer(local_prefill_threshold=200).place(0, _loads(0), _req(100)).prefill == "cpu:1"
