"""The one device switch of the in-process real-NIXL tests (tests/nixl) and of the GPU check
(scripts/gpu_check.sh): ``PD_TEST_DEVICE=cpu`` (the default) keeps every registered buffer in
DRAM; ``cuda`` puts it in VRAM, registered with NIXL as VRAM (UCX's cuda_ipc / cuda_copy
transports instead of cma).

Byte checks read a host copy (``host``); writes go through ``write``/``zero``, which wait for the
device, so no NIXL READ races a fill still queued on a CUDA stream.
"""

from __future__ import annotations

import os

import numpy as np
import torch

ENV = "PD_TEST_DEVICE"
CHOICES = ("cpu", "cuda")


def name() -> str:
    """The device the tests run on: ``cpu`` or ``cuda`` (anything else is refused)."""
    value = os.environ.get(ENV, "cpu").strip().lower() or "cpu"
    if value not in CHOICES:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(CHOICES)}")
    return value


def on_cuda() -> bool:
    return name() == "cuda"


def unavailable() -> str | None:
    """Why the chosen device cannot be used here (None: it can)."""
    if on_cuda() and not torch.cuda.is_available():
        return f"{ENV}=cuda but torch {torch.__version__} sees no CUDA device"
    return None


def device() -> torch.device:
    return torch.device("cuda", 0) if on_cuda() else torch.device("cpu")


def mem_type() -> str:
    """NIXL's memory type for buffers on this device."""
    return "VRAM" if on_cuda() else "DRAM"


def sync() -> None:
    if on_cuda():
        torch.cuda.synchronize()


def zeros(nbytes: int) -> torch.Tensor:
    out = torch.zeros(nbytes, dtype=torch.uint8, device=device())
    sync()
    return out


def write(buf: torch.Tensor, data: np.ndarray, offset: int = 0) -> None:
    """``buf[offset : offset + len(data)] = data`` (uint8), finished before it returns."""
    buf[offset : offset + data.size].copy_(torch.from_numpy(np.ascontiguousarray(data, dtype=np.uint8)))
    sync()


def zero(buf: torch.Tensor) -> None:
    buf.zero_()
    sync()


def random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    """``nbytes`` seeded random bytes on the device (the same bytes on every device)."""
    buf = zeros(nbytes)
    write(buf, np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8))
    return buf


def host(buf: torch.Tensor) -> np.ndarray:
    """The bytes of ``buf`` as numpy: a view on CPU, a copy on CUDA (so write through ``write``)."""
    if buf.device.type == "cpu":
        return buf.numpy()
    sync()
    return buf.cpu().numpy()


def transport(**kw):
    """A ``NixlTransport`` for buffers on this device."""
    from pd_connector.transport.nixl import NixlTransport

    return NixlTransport(mem_type=mem_type(), **kw)
