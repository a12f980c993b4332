"""Test lanes: the CPU lane runs the Triton kernels under Triton's interpreter; the GPU lane
(``--device cuda`` or a visible CUDA device) runs them on the GPU and adds ``-m gpu`` tests.

``TRITON_INTERPRET`` must be set before triton is first imported, so it is set here, at
collection, when no CUDA device is in use (nothing else imports triton before conftest).
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption(
        "--device",
        default=None,
        help="device for the kernel tests: 'cuda' (GPU lane) or 'cpu' (CPU lane: Triton's "
        "interpreter). Default: cuda when available, else cpu.",
    )


def _device_name(config) -> str:
    name = config.getoption("--device")
    return name or ("cuda" if torch.cuda.is_available() else "cpu")


def pytest_configure(config):
    if _device_name(config) == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # `mlarope info` keeps the transformers family report on disk: not in the user's cache.
    os.environ.setdefault("MLAROPE_CACHE_DIR", tempfile.mkdtemp(prefix="mlarope-test-cache-"))


def pytest_collection_modifyitems(config, items):
    if _device_name(config) == "cuda":
        skip, marker = pytest.mark.skip(reason="CPU lane only (needs Triton's interpreter)"), "cpu"
    else:
        skip, marker = pytest.mark.skip(reason="GPU lane only (needs a CUDA device)"), "gpu"
    for item in items:
        if marker in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device(request) -> torch.device:
    """Where kernel tests put their tensors: CUDA (GPU lane) or CPU (interpreter lane)."""
    return torch.device(_device_name(request.config))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
