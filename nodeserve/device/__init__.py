"""Devices behind one small interface: parse names, list what exists, build the right Device."""

from __future__ import annotations

from typing import Callable

from nodeserve.device.base import Device, DeviceNameError, available_devices, parse_device_name, upload


def make_device(name: str, on_thread_start: Callable[[], None] | None = None,
                on_lend: Callable[[bool], None] | None = None) -> Device:
    """The device `name` names; a CPU device with its core-lending hooks (CPUDevice), which a GPU has none of."""
    parsed = parse_device_name(name)
    if parsed.startswith("cpu:"):
        from nodeserve.device.cpu import CPUDevice

        return CPUDevice(int(parsed[4:]), on_thread_start, on_lend)
    from nodeserve.device.cuda import CUDADevice

    return CUDADevice(int(parsed[5:]))


def auto_dtype(device_names: list[str] | tuple[str, ...]) -> str:
    """The serving dtype for model.dtype = "auto": bfloat16 on GPUs and on CPUs with hardware bf16 matmuls
    (AMX or AVX512-BF16); float32 elsewhere, where bf16 runs in software and is several times slower."""
    if any(parse_device_name(n).startswith("cuda:") for n in device_names):
        return "bfloat16"
    from nodeserve.device.cpu import has_fast_bf16

    return "bfloat16" if has_fast_bf16() else "float32"


__all__ = ["auto_dtype", "Device", "DeviceNameError", "available_devices", "make_device", "parse_device_name", "upload"]
