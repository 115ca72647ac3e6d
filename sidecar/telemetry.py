"""GPU telemetry through NVML (nvidia-ml-py), cleanly absent where there is no NVIDIA driver.

GetInfo reports one `GpuTelemetry` per visible GPU. On a CPU-only machine `pynvml` imports but
`nvmlInit` raises `NVMLError` (no driver library); then, and if the package is missing, the
list is empty and nothing is logged more than once. Each reading that a device does not
support (e.g. power on some boards) is left at 0 rather than failing the whole report.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from sidecar.types import GpuTelemetry

log = logging.getLogger(__name__)
T = TypeVar("T")

_lock = threading.Lock()
_state: dict[str, Any] = {"tried": False, "nvml": None}


def _nvml() -> Any:
    """The initialised pynvml module, or None without a usable NVIDIA driver."""
    with _lock:
        if not _state["tried"]:
            _state["tried"] = True
            try:
                import pynvml
            except ImportError:
                log.info("nvidia-ml-py is not installed; GPU telemetry is off")
                return None
            try:
                pynvml.nvmlInit()
            except pynvml.NVMLError as e:
                log.info("NVML unavailable (%s); GPU telemetry is off", e)
                return None
            _state["nvml"] = pynvml
        return _state["nvml"]


def _read(nvml: Any, default: T, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args), or `default` when the device does not support that reading."""
    try:
        return fn(*args)
    except nvml.NVMLError:
        return default


def gpu_telemetry() -> list[GpuTelemetry]:
    """Live readings of every visible GPU; [] without NVML."""
    nvml = _nvml()
    if nvml is None:
        return []
    try:
        count = nvml.nvmlDeviceGetCount()
    except nvml.NVMLError as e:
        log.warning("NVML device count failed: %s", e)
        return []
    gpus = []
    for i in range(count):
        try:
            h = nvml.nvmlDeviceGetHandleByIndex(i)
        except nvml.NVMLError:
            continue
        name: Any = _read(nvml, "", nvml.nvmlDeviceGetName, h)
        mem: Any = _read(nvml, None, nvml.nvmlDeviceGetMemoryInfo, h)
        rates: Any = _read(nvml, None, nvml.nvmlDeviceGetUtilizationRates, h)
        util = rates.gpu if rates is not None else 0
        temp: Any = _read(nvml, 0, nvml.nvmlDeviceGetTemperature, h, nvml.NVML_TEMPERATURE_GPU)
        power_mw: Any = _read(nvml, 0, nvml.nvmlDeviceGetPowerUsage, h)
        gpus.append(
            GpuTelemetry(
                index=i,
                name=name.decode() if isinstance(name, bytes) else str(name),
                memory_total_bytes=int(mem.total) if mem is not None else 0,
                memory_used_bytes=int(mem.used) if mem is not None else 0,
                utilization_percent=int(util),
                temperature_celsius=int(temp),
                power_watts=power_mw / 1000.0,
            )
        )
    return gpus
