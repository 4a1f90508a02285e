"""The image itself, built and run by deploy/docker/smoke.sh as the Kubernetes CPU Deployment runs
it (uid 10001, read-only root, capabilities dropped, a CPU quota), when a Docker daemon answers here.
CI starts none, so there this test is skipped and says why; docs/DEPLOY.md has the figures of the
last run by hand.

    KIMI_VISION_SMOKE_BASE   the base image (default: the Dockerfile's, which needs registry access)
    KIMI_VISION_SMOKE_BUILD  more `docker build` options, shell-quoted (--secret id=ca,src=..., --build-arg ...)
    DOCKER                   the Docker client (default: docker)
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess

import pytest
from conftest import REPO_ROOT
from dockerfile_parse import DockerfileParser

SMOKE = REPO_ROOT / "deploy" / "docker" / "smoke.sh"
DOCKER = os.environ.get("DOCKER", "docker")


def _daemon_problem() -> str | None:
    """Why no Docker daemon can be used here, or None when one answers."""
    if shutil.which(DOCKER) is None:
        return f"no Docker client {DOCKER!r} on PATH"
    try:
        info = subprocess.run([DOCKER, "version", "--format", "{{.Server.Version}}"], capture_output=True,
                              text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "the Docker daemon did not answer within 30 s"
    if info.returncode != 0 or not info.stdout.strip():
        said = info.stderr.strip().splitlines()
        return f"no Docker daemon answers ({said[-1] if said else f'docker version exited {info.returncode}'})"
    return None


def _default_base() -> str:
    (arg,) = [i["value"] for i in DockerfileParser(path=str(REPO_ROOT / "Dockerfile")).structure
              if i["instruction"] == "ARG" and i["value"].startswith("BASE_IMAGE=")]
    return arg.partition("=")[2]


@pytest.mark.timeout(3600)  # a first build downloads torch
def test_the_cpu_image_serves_as_the_deployment_runs_it():
    problem = _daemon_problem()
    if problem:
        pytest.skip(f"{problem}: the image is not built here (deploy/docker/smoke.sh does it where Docker runs)")
    base = os.environ.get("KIMI_VISION_SMOKE_BASE", _default_base())
    command = ["bash", str(SMOKE), base, *shlex.split(os.environ.get("KIMI_VISION_SMOKE_BUILD", ""))]
    done = subprocess.run(command, cwd=REPO_ROOT, env={**os.environ, "DOCKER": DOCKER}, capture_output=True,
                          text=True, timeout=3500)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-6000:]
    result = re.search(r"^== passed: image \S+ (\d+) bytes .*, docker stop ([\d.]+) s$", done.stdout, re.M)
    assert result, done.stdout[-3000:]
    size, stop_s = int(result[1]), float(result[2])
    assert size <= 1_800_000_000 and stop_s < 5  # what smoke.sh checks, read back from what it reports
    print(f"\nimage {size / 1e9:.2f} GB, docker stop {stop_s:.2f} s")
