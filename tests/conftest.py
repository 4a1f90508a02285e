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


@pytest.fixture(scope="session")
def tiny_checkpoint() -> Path:
    """The embedded default checkpoint (tiny random tower and projector, MXFP4 trunk, tiny
    tokenizer): what every command runs without --checkpoint. Shared: a test that changes a
    checkpoint works on a copy."""
    from service.checkpoints.default import default_checkpoint_dir

    return default_checkpoint_dir()


@pytest.fixture(scope="session")
def tiny_encoder(tiny_checkpoint: Path):
    """The tiny checkpoint's tower and projector, in this process (the reference a worker's rows equal)."""
    from vision.encoder import VisionEncoder

    return VisionEncoder.from_checkpoint(tiny_checkpoint)


@pytest.fixture(scope="module")
def tiny_engine(tiny_checkpoint: Path):
    """An engine on the tiny checkpoint with one CPU encoder worker and no embedding cache (every
    image reaches a worker), for the module that asks."""
    from service.engine import Engine, EngineConfig

    engine = Engine.load(EngineConfig(checkpoint=tiny_checkpoint, devices="cpu:1", cache_bytes=0))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def rpc_client(server):
    """A blocking gRPC client of the module's own `server` fixture (a server thread or process: anything
    with a `target`)."""
    from service.rpc.client import VisionClient

    with VisionClient(server.target, timeout=120) as client:
        yield client


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's tiny tokenizer files (textcore.tiny_vocab), written once."""
    from textcore.tiny_vocab import write_tiny_tokenizer

    return write_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir: Path):
    from textcore.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(tiny_tokenizer_dir)
