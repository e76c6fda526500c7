"""Devices behind one small interface: parse names, list what exists, build the right Device."""

from __future__ import annotations

from typing import Callable

from nodeserve.device.base import (Device, DeviceNameError, available_devices, group_ranks, parse_device_name,
                                   upload)


def make_device(name: str, on_thread_start: Callable[[], None] | None = None,
                on_lend: Callable[[bool], None] | None = None) -> Device:
    """The device `name` names; a CPU device with its core-lending hooks (CPUDevice), which a GPU has none of; a
    tensor-parallel group ("cpu:0+cpu:1") as one DeviceGroup of its ranks (which lend nothing)."""
    parsed = parse_device_name(name)
    if "+" in parsed:
        from nodeserve.device.group import DeviceGroup

        return DeviceGroup([make_device(r) for r in group_ranks(parsed)])
    if parsed.startswith("cpu:"):
        from nodeserve.device.cpu import CPUDevice, core_of

        return CPUDevice(int(parsed[4:]), on_thread_start, on_lend, core=core_of(int(parsed[4:])))
    from nodeserve.device.cuda import CUDADevice

    return CUDADevice(int(parsed[5:]))


def auto_dtype(device_names: list[str] | tuple[str, ...]) -> str:
    """The serving dtype for model.dtype = "auto": bfloat16 on GPUs and on CPUs with hardware bf16 matmuls
    (AMX or AVX512-BF16); float32 elsewhere, where bf16 runs in software and is several times slower."""
    if any(parse_device_name(n).startswith("cuda:") for n in device_names):
        return "bfloat16"
    from nodeserve.device.cpu import has_fast_bf16

    return "bfloat16" if has_fast_bf16() else "float32"


__all__ = ["auto_dtype", "Device", "DeviceNameError", "available_devices", "group_ranks", "make_device", "parse_device_name",
           "upload"]
