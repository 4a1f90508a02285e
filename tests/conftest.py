import os
from pathlib import Path

import pytest

# Triton kernels run on the CPU only in the interpreter, and the variable must be set before
# any module that defines a kernel is imported. Tests never have a GPU here; a GPU run of the
# kernels goes through bench/, not through the unit tests.
os.environ.setdefault("TRITON_INTERPRET", "1")

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def torch_one_thread():
    """Small ops on a CPU shared by many processes: extra torch threads only add contention."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
