"""Devices behind one small interface: parse names, list what exists, build the right Device."""

from __future__ import annotations

from nodeserve.device.base import Device, DeviceNameError, available_devices, parse_device_name


def make_device(name: str) -> Device:
    parsed = parse_device_name(name)
    if parsed.startswith("cpu:"):
        from nodeserve.device.cpu import CPUDevice

        return CPUDevice(int(parsed[4:]))
    from nodeserve.device.cuda import CUDADevice

    return CUDADevice(int(parsed[5:]))


__all__ = ["Device", "DeviceNameError", "available_devices", "make_device", "parse_device_name"]
