"""--gpu / --cpu resolution, with torch's CUDA queries patched (pure logic, no GPU needed)."""

from __future__ import annotations

import pytest
import torch

from parallax.errors import NodeError
from parallax.node.train.device import DeviceError, resolve_device


@pytest.fixture
def cuda(monkeypatch):
    """Pretend torch sees ``count`` CUDA devices (0 = a CPU-only build)."""

    def set_count(count: int, cuda_version: str | None = "12.4") -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"NVIDIA Test GPU {i}")
        monkeypatch.setattr(torch.version, "cuda", cuda_version)

    return set_count


def test_cpu_flag_gives_cpu_even_with_cuda(cuda):
    cuda(2)
    assert resolve_device(None, True) == torch.device("cpu")


def test_gpu_index_within_range(cuda):
    cuda(2)
    assert resolve_device(1, False) == torch.device("cuda", 1)
    assert resolve_device(0, False) == torch.device("cuda", 0)


def test_no_flag_picks_first_gpu_or_cpu(cuda):
    cuda(2)
    assert resolve_device(None, False) == torch.device("cuda", 0)
    cuda(0)
    assert resolve_device(None, False) == torch.device("cpu")


def test_gpu_and_cpu_together_are_refused(cuda):
    cuda(1)
    with pytest.raises(DeviceError, match="exclude each other"):
        resolve_device(0, True)


def test_gpu_without_cuda_names_the_build_and_the_fix(cuda, monkeypatch):
    cuda(0, cuda_version=None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(DeviceError) as err:
        resolve_device(0, False)
    msg = str(err.value)
    assert "no CUDA device is visible to torch" in msg
    assert "torch.version.cuda=None" in msg and "CUDA_VISIBLE_DEVICES=''" in msg
    assert "install a CUDA build of torch or pass --cpu" in msg


def test_unset_visible_devices_is_reported_as_unset(cuda, monkeypatch):
    cuda(0)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(DeviceError, match="CUDA_VISIBLE_DEVICES=<unset>"):
        resolve_device(0, False)


def test_out_of_range_lists_visible_devices(cuda):
    cuda(2)
    with pytest.raises(DeviceError) as err:
        resolve_device(2, False)
    msg = str(err.value)
    assert "--gpu 2 is out of range" in msg
    assert "0: NVIDIA Test GPU 0" in msg and "1: NVIDIA Test GPU 1" in msg
    assert "--gpu 0..1" in msg


def test_negative_index_is_refused(cuda):
    cuda(1)
    with pytest.raises(DeviceError, match=">= 0"):
        resolve_device(-1, False)


def test_error_is_a_value_error_and_a_node_error(cuda):
    cuda(0)
    with pytest.raises(ValueError):
        resolve_device(0, False)
    with pytest.raises(NodeError):
        resolve_device(0, False)
