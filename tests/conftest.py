import asyncio
import os
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest

# Triton kernels run on the CPU only in the interpreter, and the variable must be set before
# any module that defines a kernel is imported. Tests never have a GPU here; a GPU run of the
# kernels goes through bench/, not through the unit tests.
os.environ.setdefault("TRITON_INTERPRET", "1")

REPO_ROOT = Path(__file__).resolve().parent.parent

# grpc.aio clients on successive event loops in one process eventually lose completions (a late
# event for a closed loop aborts the batch it arrived in) and their calls hang until the deadline.
# So every test coroutine runs on one loop that lives as long as the session (pytest-asyncio's
# tests too: `asyncio_default_test_loop_scope = "session"` in pyproject.toml).
_RUNNER: asyncio.Runner | None = None


def run_async(coro: Coroutine[Any, Any, Any]) -> Any:
    """`asyncio.run` for tests, on the session's one event loop."""
    global _RUNNER
    if _RUNNER is None:
        _RUNNER = asyncio.Runner()
    return _RUNNER.run(coro)


@pytest.fixture(scope="module")
def torch_one_thread():
    """Small ops on a CPU shared by many processes: extra torch threads only add contention."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
