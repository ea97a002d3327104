"""Which torch device a node trains on, from ``--gpu N`` / ``--cpu``.

Failures say what torch sees and what to pass instead: a node that silently trains on the CPU when
the user asked for a GPU wastes hours before anyone notices.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import torch

from parallax.errors import NodeError

log = logging.getLogger(__name__)


class DeviceError(NodeError, ValueError):
    """The requested device cannot be used; the message says what torch sees and what to pass."""


def resolve_device(gpu: int | None, cpu: bool) -> torch.device:
    """The device for ``--gpu N`` / ``--cpu``.

    Args:
        gpu: the CUDA device index (as numbered after ``CUDA_VISIBLE_DEVICES``), or None.
        cpu: train on the CPU.

    Returns:
        ``cpu`` with --cpu; ``cuda:N`` with --gpu N; with neither flag, ``cuda:0`` when torch sees a
        CUDA device and ``cpu`` otherwise (logged).

    Raises:
        DeviceError: --gpu with --cpu, a negative index, --gpu without a visible CUDA device, or an
            index past the visible devices (which are listed with their names).
    """
    if cpu and gpu is not None:
        raise DeviceError(f"--gpu {gpu} and --cpu exclude each other: pass --gpu N to train on CUDA device N, "
                          "or --cpu alone")
    if cpu:
        return torch.device("cpu")
    if gpu is not None and gpu < 0:
        raise DeviceError(f"--gpu must be a device index >= 0, got {gpu}; pass --cpu to train on the CPU")
    available = torch.cuda.is_available()
    if gpu is None:
        if available:
            return torch.device("cuda", 0)
        log.info("no CUDA device visible to torch; training on the CPU (pass --gpu N to require a GPU)")
        return torch.device("cpu")
    if not available:
        raise DeviceError(f"--gpu {gpu}: no CUDA device is visible to torch ({_environment()}): "
                          "install a CUDA build of torch or pass --cpu")
    count = torch.cuda.device_count()
    if gpu >= count:
        raise DeviceError(f"--gpu {gpu} is out of range: torch sees {count} CUDA device(s) ({_listing(count)}; "
                          f"{_environment()}); pass --gpu 0..{count - 1}, indices count from 0 after "
                          "CUDA_VISIBLE_DEVICES")
    return torch.device("cuda", gpu)


def _environment() -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = "<unset>" if visible is None else repr(visible)
    return f"torch.version.cuda={torch.version.cuda}, CUDA_VISIBLE_DEVICES={shown}"


def _listing(count: int) -> str:
    names = []
    for i in range(count):
        try:
            names.append(f"{i}: {torch.cuda.get_device_name(i)}")
        except Exception:  # a device torch counts but cannot query is still worth listing by index
            names.append(f"{i}: (name unavailable)")
    return ", ".join(names)


def device_setting(gpu: int | None, cpu: bool) -> str | None:
    """The ``device`` setting that ``--gpu N`` / ``--cpu`` ask for (None: neither flag, the setting stands).

    Raises:
        DeviceError: both flags, or a negative index.
    """
    if cpu and gpu is not None:
        raise DeviceError(f"--gpu {gpu} and --cpu exclude each other: pass --gpu N to train on CUDA device N, "
                          "or --cpu alone")
    if gpu is not None and gpu < 0:
        raise DeviceError(f"--gpu must be a device index >= 0, got {gpu}; pass --cpu to train on the CPU")
    return "cpu" if cpu else (f"cuda:{gpu}" if gpu is not None else None)


def device_of(setting: str) -> torch.device:
    """The torch device for a ``device`` setting (auto, cpu, cuda, cuda:N), checked as ``resolve_device`` checks.

    Raises:
        DeviceError: the device cannot be used (the message says what torch sees and what to pass).
    """
    if setting == "auto":
        return resolve_device(None, False)
    if setting == "cpu":
        return resolve_device(None, True)
    _, _, index = setting.partition(":")
    return resolve_device(int(index or 0), False)


def compute_dtype(device: torch.device, precision: str) -> torch.dtype:
    """The dtype matmuls run in for a ``compute.precision`` on ``device`` (weights and optimizer state stay
    float32): bfloat16 for "bf16", and for "auto" on a CUDA device that supports it; float32 otherwise.

    Raises:
        DeviceError: "bf16" on a CUDA device without bfloat16.
    """
    if precision == "fp32":
        return torch.float32
    bf16_cuda = device.type == "cuda" and torch.cuda.is_bf16_supported()
    if precision == "bf16":
        if device.type == "cuda" and not bf16_cuda:
            raise DeviceError(f"compute.precision=bf16: {device} has no bfloat16 support "
                              f"({torch.cuda.get_device_name(device)}); set compute.precision=fp32")
        return torch.bfloat16
    return torch.bfloat16 if bf16_cuda else torch.float32


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager[object]:
    """Mixed precision for a forward pass: autocast to ``dtype`` on ``device``; nothing for float32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


@contextlib.contextmanager
def threads(count: int | None) -> Iterator[None]:
    """torch's CPU operations on ``count`` intra-op threads inside, the process's setting again after (None: the
    process's setting throughout)."""
    if count is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
