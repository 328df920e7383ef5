"""The GPU adapter: which one the walkers use (``_get_adapter``: wgpu's high-performance adapter,
requested once per process) and ``adapter_info`` (name, vendor, backend, whether it is a software
rasteriser such as Mesa lavapipe / llvmpipe). Imports only wgpu, and that when first asked, so that
runtime.walkers.prepare can request the adapter, mostly driver work outside the GIL, before the
process imports Numba and the device layer (runtime/gpu_device.py, which uses it).
"""
from __future__ import annotations

import threading

__all__ = ["adapter_info"]

_adapter_lock = threading.Lock()
_adapter = None
_adapter_tried = False


def _wgpu():
    import wgpu
    return wgpu


def _get_adapter():
    global _adapter, _adapter_tried
    with _adapter_lock:
        if not _adapter_tried:
            _adapter_tried = True
            try:
                _adapter = _wgpu().gpu.request_adapter_sync(power_preference="high-performance")
            except Exception:   # no Vulkan / Metal / DX12 driver at all: the walker is absent
                _adapter = None
        return _adapter


def adapter_info() -> dict | None:
    """The adapter the walker uses (None without one): name, vendor, backend, type, software."""
    a = _get_adapter()
    if a is None:
        return None
    info = dict(a.info)
    name = info.get("device") or info.get("description") or "unknown"
    text = " ".join(str(info.get(k, "")) for k in ("vendor", "device", "description")).lower()
    return dict(name=name, vendor=info.get("vendor", ""), backend=info.get("backend_type", ""),
                adapter_type=info.get("adapter_type", ""), driver=info.get("description", ""),
                software=("llvmpipe" in text or "lavapipe" in text or info.get("adapter_type") == "CPU"))
