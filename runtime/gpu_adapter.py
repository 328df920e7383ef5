"""The GPU adapter: which one the walkers use (``get_adapter``: wgpu's high-performance adapter,
requested once per process), ``adapter_info`` (name, vendor, backend, whether it is a software
rasteriser such as Mesa lavapipe / llvmpipe) and its device (``open_device``, ``take_device``).
Imports only wgpu, and that when first asked, so that runtime.walkers.prepare can request the
adapter and the device, driver work outside the GIL (on the H200 0.55-0.97 s and 0.35-0.47 s),
while the process imports the device layer (runtime/gpu_device.py, which takes the device).
"""
from __future__ import annotations

import threading

__all__ = ["adapter_info", "get_adapter", "load_wgpu", "open_device", "opened_ahead", "take_device"]

DEVICE_LIMITS = ("max_storage_buffer_binding_size", "max_buffer_size")   # asked for at the adapter's values

_adapter_lock = threading.Lock()
_adapter = None
_adapter_tried = False
_opened: list = []        # the device open_device opened and take_device has not taken


def load_wgpu():
    """The wgpu module, imported on the first call."""
    import wgpu
    return wgpu


def get_adapter():
    """wgpu's high-performance adapter, requested once per process (None: no GPU driver)."""
    global _adapter, _adapter_tried
    with _adapter_lock:
        if not _adapter_tried:
            _adapter_tried = True
            try:
                _adapter = load_wgpu().gpu.request_adapter_sync(power_preference="high-performance")
            except Exception:   # no Vulkan / Metal / DX12 driver at all: the walker is absent
                _adapter = None
        return _adapter


def adapter_info() -> dict | None:
    """The adapter the walker uses (None without one): name, vendor, backend, type, software."""
    a = get_adapter()
    if a is None:
        return None
    info = dict(a.info)
    name = info.get("device") or info.get("description") or "unknown"
    text = " ".join(str(info.get(k, "")) for k in ("vendor", "device", "description")).lower()
    return dict(name=name, vendor=info.get("vendor", ""), backend=info.get("backend_type", ""),
                adapter_type=info.get("adapter_type", ""), driver=info.get("description", ""),
                software=("llvmpipe" in text or "lavapipe" in text or info.get("adapter_type") == "CPU"))


def open_device():
    """Open the adapter's device now (once, thread-safe; with DEVICE_LIMITS at the adapter's
    values), for ``take_device``, and return it; nothing (None) without an adapter, or where
    opening fails (then take_device opens it again and raises what went wrong)."""
    with _adapter_lock:
        if _opened:
            return _opened[0]
    adapter = get_adapter()
    if adapter is None:
        return None
    try:
        device = _request_device(adapter)
    except Exception:
        return None
    with _adapter_lock:
        if not _opened:
            _opened.append(device)
        return _opened[0]


def opened_ahead() -> int:
    """How many devices open_device opened that take_device has not handed out (0 or 1)."""
    with _adapter_lock:
        return len(_opened)


def take_device():
    """The device open_device opened (handed out once), else a new one of the adapter."""
    with _adapter_lock:
        if _opened:
            return _opened.pop()
    return _request_device(get_adapter())


def _request_device(adapter):
    limits = {k: adapter.limits[k.replace("_", "-")] for k in DEVICE_LIMITS}
    return adapter.request_device_sync(label="taperay", required_limits=limits)
