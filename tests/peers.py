"""The peers' released code the EPD tests run against, fetched at test time instead of kept here.

Each artifact is a file PyPI serves, pinned by URL and sha256. The first test that needs one
downloads it (urllib) into `~/.cache/kimi-vision/peers/` (`$XDG_CACHE_HOME/kimi-vision/peers`
where that is set), checks its sha256 and extracts what the tests use beside it; every later run on
the machine finds the extracted directory and touches no network. Two pytest processes may race:
each writes to a temporary name in the cache and renames it into place (`os.replace`), so a reader
sees a whole file or directory or none.

- A sha256 that differs from the pin fails the test (`pytest.fail`): the file is not the release.
- No network (the download cannot be made) skips it (`pytest.skip`), naming the URL.

`sglang()` is SGLang 0.5.23's wheel, unpacked as a directory for `sys.path`; `vllm_epd_proxy()` is
the EPD proxy script from vLLM 0.33.0's sdist; `vllm_models()` the pydantic response models of its
OpenAI server (completions, tokenize, detokenize), built from the sdist's own source at test time;
`torchvision()` is the torchvision wheel SGLang's imports need when none that imports is installed
(see `sglang_importable`).
"""

from __future__ import annotations

import hashlib
import http.client
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

SGLANG_VERSION = "0.5.23"
VLLM_VERSION = "0.33.0"
TORCHVISION_VERSION = "0.28.0"  # the release built for torch 2.13.0, run.sh's TORCH_VERSION
TIMEOUT_S = 60
CHUNK = 1 << 20


@dataclass(frozen=True)
class Artifact:
    url: str
    sha256: str

    @property
    def filename(self) -> str:
        return self.url.rsplit("/", 1)[1]


SGLANG_WHEEL = Artifact(
    "https://files.pythonhosted.org/packages/57/dd/0206d00b2ea5b163bbdd216e91cc4f23ea90fde8620db0a6272d4236b68e/"
    "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl",
    "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937")
VLLM_SDIST = Artifact(
    "https://files.pythonhosted.org/packages/f7/25/aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/"
    "vllm-0.33.0.tar.gz",
    "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112")
VLLM_EPD_PROXY = "vllm-0.33.0/examples/disaggregated/disaggregated_encoder/disagg_epd_proxy.py"
VLLM_EPD_PROXY_SHA256 = "dff7b4dd37b0ef1c26330fb79b15749d871ef37ca66cc8448e678aa143068ca2"
TORCHVISION_WHEEL = Artifact(
    "https://files.pythonhosted.org/packages/0b/9b/f1e68e861d4462e3e195a642c2b448e7b7d3fad5f209487162b9a2133d9b/"
    "torchvision-0.28.0-cp311-cp311-manylinux_2_28_x86_64.whl",
    "7e80f543b22503d9415e126db5f0ff3917036925e38560ee6b9ae38c571a4002")


def cache_dir() -> Path:
    """Outside any checkout, shared by every clone and worktree on the machine."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    path = base / "kimi-vision" / "peers"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _mismatch(what: str, expected: str, got: str, where: str):
    pytest.fail(f"sha256 mismatch for {what}: expected {expected}, got {got}; {where}", pytrace=False)


def download(artifact: Artifact) -> Path:
    """The artifact's file in the cache, its sha256 checked; downloaded when it is not there yet."""
    path = cache_dir() / artifact.filename
    if path.exists():
        if (got := _sha256(path)) != artifact.sha256:
            _mismatch(artifact.url, artifact.sha256, got, f"the cached {path} is not the pinned release: find "
                      "out why before deleting it")
        return path
    fd, tmp_name = tempfile.mkstemp(prefix=f".{artifact.filename}.", suffix=".part", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            try:
                with urllib.request.urlopen(artifact.url, timeout=TIMEOUT_S) as reply:
                    while block := reply.read(CHUNK):
                        digest.update(block)
                        out.write(block)
            except urllib.error.HTTPError as e:
                if e.code in (404, 410):  # reached PyPI, and the pinned file is not there: not a network problem
                    pytest.fail(f"{artifact.url}: HTTP {e.code}; the pinned release is gone", pytrace=False)
                pytest.skip(f"cannot download {artifact.url} (HTTP {e.code}); offline?", allow_module_level=True)
            except (urllib.error.URLError, http.client.HTTPException, TimeoutError, ConnectionError) as e:
                pytest.skip(f"cannot download {artifact.url} ({e}); offline?", allow_module_level=True)
        if (got := digest.hexdigest()) != artifact.sha256:
            _mismatch(artifact.url, artifact.sha256, got, "the download is not the pinned release (not kept)")
        tmp.chmod(0o644)  # mkstemp's 0600 is for the file being written, not for the cache
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _unpacked(name: str, fill) -> Path:
    """`cache_dir()/name`, made once by `fill(directory)` in a temporary directory renamed into place.
    A process that loses the race drops its own copy and takes the winner's."""
    dest = cache_dir() / name
    if dest.is_dir():
        return dest
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=dest.parent))
    try:
        fill(tmp)
        tmp.chmod(0o755)  # mkdtemp's 0700 likewise
        try:
            os.replace(tmp, dest)
        except OSError:
            if not dest.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _wheel(artifact: Artifact) -> Path:
    """A wheel unpacked (a zip: its packages and its .dist-info), a directory to put on `sys.path`."""
    name = artifact.filename.removesuffix(".whl") + f"-{artifact.sha256[:12]}"
    dest = cache_dir() / name
    if dest.is_dir():
        return dest

    def fill(tmp: Path) -> None:
        with zipfile.ZipFile(download(artifact)) as wheel:
            wheel.extractall(tmp)

    return _unpacked(name, fill)


@cache
def sglang() -> Path:
    """SGLang 0.5.23's wheel unpacked: the directory that holds its `sglang` package."""
    return _wheel(SGLANG_WHEEL)


@cache
def torchvision() -> Path:
    """torchvision 0.28.0's wheel unpacked (the directory that holds its `torchvision` package)."""
    return _wheel(TORCHVISION_WHEEL)


@cache
def vllm_epd_proxy() -> Path:
    """vLLM 0.33.0's `examples/disaggregated/disaggregated_encoder/disagg_epd_proxy.py`, taken out of
    its sdist alone, its own sha256 checked on every call."""
    name = f"vllm-{VLLM_VERSION}-{VLLM_SDIST.sha256[:12]}"
    relative = Path(VLLM_EPD_PROXY)

    def fill(tmp: Path) -> None:
        with tarfile.open(download(VLLM_SDIST), "r:gz") as sdist:
            member = sdist.getmember(VLLM_EPD_PROXY)
            sdist.extractall(tmp, members=[member], filter="data")

    script = _unpacked(name, fill) / relative
    if (got := _sha256(script)) != VLLM_EPD_PROXY_SHA256:
        _mismatch(f"{VLLM_SDIST.url} ({VLLM_EPD_PROXY})", VLLM_EPD_PROXY_SHA256, got,
                  f"the cached {script} is not the pinned release's: find out why before deleting it")
    return script


def _torchvision_imports() -> bool:
    """Whether a torchvision is installed that imports (PyPI's Linux wheel, built for CUDA torch, does
    not next to a CPU build of torch); asked in a child process, as a failed import leaves torch's
    operator registry half-written."""
    import importlib.util
    import subprocess

    if importlib.util.find_spec("torchvision") is None:
        return False
    return subprocess.run([sys.executable, "-c", "import torchvision"], capture_output=True).returncode == 0


@cache
def sglang_importable() -> Path:
    """Puts SGLang 0.5.23's unpacked wheel on `sys.path`, and what its imports need that pip does not
    give a CPU machine: SGLang's `sglang.srt.configs` imports torchvision (`internvl_utils`), and
    PyPI's torchvision is a CUDA build whose C++ ops (`_C.so`) need CUDA torch's libraries.

    With a CPU torch, that wheel's `torchvision/_meta_registrations.py` then registers fake kernels
    for `torchvision::nms` and `torchvision::qnms` without first asking whether its ops loaded, and
    torch refuses an operator it has never seen. So when the installed torchvision (if any) does not
    import, torchvision 0.28.0's own wheel is fetched (torch 2.13.0 is what run.sh installs; another
    torch is skipped) and, if its ops cannot load, the two operators' schemas are declared, with no
    kernel: SGLang's receiver never calls them. This is the one thing in these tests that stands in
    for a peer's code. Returns the directory put on `sys.path`."""
    import torch

    path = sglang()
    if not _torchvision_imports():
        if torch.__version__.split("+")[0] != "2.13.0":
            pytest.skip(f"SGLang's imports need torchvision; none imports next to torch {torch.__version__}, and "
                        f"the one fetched here ({TORCHVISION_VERSION}) is for torch 2.13.0", allow_module_level=True)
        vision = torchvision()
        try:
            torch.ops.load_library(str(vision / "torchvision" / "_C.so"))
        except OSError:
            for op in ("nms", "qnms"):  # as torchvision's C++ declares them
                torch.library.define(f"torchvision::{op}",
                                     "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        if str(vision) not in sys.path:
            sys.path.insert(0, str(vision))  # before an installed torchvision that does not import
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
    return path


# vLLM 0.33.0's response models and what they are made of, each in the sdist file that defines it,
# in the order they must be defined. The protocol modules import all of vLLM (torch, its engine
# config) for their request types; the response models need none of that, so each definition is
# read out of its file's syntax tree and run alone, with the few names they use.
VLLM_MODELS = (
    ("vllm/utils/__init__.py", ("MASK_64_BITS", "random_uuid")),
    ("vllm/logprobs.py", ("Logprob",)),
    ("vllm/outputs.py", ("WeightVersionSpan",)),
    ("vllm/entrypoints/serve/engine/protocol.py", ("_REMOVED_GUIDED_FIELDS", "OpenAIBaseModel",
                                                   "PromptTokenUsageInfo", "CompletionTokenUsageInfo", "UsageInfo")),
    ("vllm/entrypoints/generate/base/protocol.py", ("SpeculativeDecodingMetrics", "PerRequestMetrics")),
    ("vllm/entrypoints/openai/completion/protocol.py", (
        "CompletionLogProbs", "CompletionResponseChoice", "CompletionResponse", "CompletionResponseStreamChoice",
        "CompletionStreamResponse")),
    ("vllm/entrypoints/serve/tokenize/protocol.py", ("TokenizeResponse", "DetokenizeResponse")),
)


@cache
def vllm_models() -> dict[str, type]:
    """vLLM 0.33.0's response models by class name (`CompletionResponse`, `CompletionStreamResponse`,
    `TokenizeResponse`, `DetokenizeResponse`, ...), defined from its sdist's source."""
    import ast
    import dataclasses
    import logging
    import time
    import types
    import typing
    import uuid

    import pydantic

    prefix = f"vllm-{VLLM_VERSION}/"
    name = f"vllm-{VLLM_VERSION}-{VLLM_SDIST.sha256[:12]}-protocol"

    def fill(tmp: Path) -> None:
        with tarfile.open(download(VLLM_SDIST), "r:gz") as sdist:
            members = [sdist.getmember(prefix + path) for path, _ in VLLM_MODELS]
            sdist.extractall(tmp, members=members, filter="data")

    root = _unpacked(name, fill) / prefix
    module = types.ModuleType("vllm_models")  # dataclasses and pydantic look their module up
    sys.modules[module.__name__] = module
    namespace = module.__dict__
    namespace |= {
        "time": time, "uuid": uuid, "dataclass": dataclasses.dataclass,
        "field": dataclasses.field, "logger": logging.getLogger("vllm"),
        **{key: getattr(typing, key) for key in ("Annotated", "Any", "ClassVar", "Literal", "TypeAlias")},
        **{key: getattr(pydantic, key) for key in ("BaseModel", "ConfigDict", "Field", "model_validator")},
    }
    for path, names in VLLM_MODELS:
        tree = ast.parse((root / path).read_text(), path)
        found = {}
        for node in tree.body:
            targets = [t.id for t in node.targets if isinstance(t, ast.Name)] if isinstance(node, ast.Assign) else [
                getattr(node, "name", None)]
            for target in targets:
                if target in names:
                    found[target] = node
        missing = sorted(set(names) - set(found))
        if missing:
            pytest.fail(f"{path} of vLLM {VLLM_VERSION} defines no {missing}", pytrace=False)
        for key in names:
            exec(compile(ast.Module([found[key]], []), str(root / path), "exec"), namespace)  # noqa: S102
    return {key: namespace[key] for _, names in VLLM_MODELS for key in names if isinstance(namespace[key], type)}
