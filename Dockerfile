# kimi-vision: the gRPC service (and its HTTP face) in a container. docs/DEPLOY.md says how to build
# and run it (also behind a TLS-intercepting proxy, offline, and without registry access).
#
#   DOCKER_BUILDKIT=1 docker build -t kimi-vision:0.1.0 .                      # CPU
#   DOCKER_BUILDKIT=1 docker build -t kimi-vision:0.1.0-cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 --build-arg EXTRAS=gpu .  # NVIDIA GPUs
#
# BuildKit (Docker's default builder since 23.0) for the mounts below. Where packages come from:
#   TORCH_INDEX_URL      torch's index: PyTorch's CPU wheels by default (an index's plain Linux torch
#                        is the CUDA build, GBs of NVIDIA libraries); empty: the one pip uses otherwise
#   PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_TRUSTED_HOST   pip's own settings, for everything else
#   --secret id=ca,src=BUNDLE   the PEM CA bundle pip trusts (a TLS-intercepting proxy's); never in the image
#   WHEELS_IMAGE, or --build-context wheels=DIR   wheels pip may install besides the indexes' (find-links)
#
# The install steps are the README's (and run.sh's, which CI runs): torch first, then the project;
# tests/test_deploy.py holds the two to the same steps. The tiny default checkpoint is made at build
# time, so the image serves with no volume; a real model is mounted and named with --checkpoint.

ARG BASE_IMAGE=python:3.11-slim-bookworm
ARG WHEELS_IMAGE=scratch

# The find-links directory: empty, unless WHEELS_IMAGE names an image holding wheels at its root or
# (Docker >= 23) --build-context wheels=DIR replaces this stage.
FROM ${WHEELS_IMAGE} AS wheels

FROM ${BASE_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# The project's extras: gpu in the CUDA image (the Triton kernels), none on CPU.
ARG EXTRAS=
# Read by pip from the environment; unset unless given.
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_TRUSTED_HOST
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# A CUDA base has no Python of its own: take the distribution's (the project needs >= 3.11), at
# the version that base's release holds.
# hadolint ignore=DL3008
RUN if ! command -v python3 >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi
RUN python3 -m venv /opt/kimi-vision
ENV PATH=/opt/kimi-vision/bin:$PATH PIP_FIND_LINKS=/wheels
# Pinned, by the build argument (which hadolint cannot see through).
# hadolint ignore=DL3013
RUN --mount=type=bind,from=wheels,target=/wheels --mount=type=secret,id=ca \
    if [ -f /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
    && pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY vision vision
COPY textcore textcore
COPY service service
# The project itself, from these sources (its dependencies are pinned by pyproject.toml's bounds).
# hadolint ignore=DL3013
RUN --mount=type=bind,from=wheels,target=/wheels --mount=type=secret,id=ca \
    if [ -f /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
    && pip install ".${EXTRAS:+[$EXTRAS]}"
# Made by the installed package (not /src's sources), where the runtime looks for it; readable by
# the runtime's user (files 0644, directories 0755: the build's umask).
WORKDIR /
ENV KIMI_VISION_CACHE=/opt/kimi-vision/models
RUN python -c "from service.checkpoints.default import default_checkpoint_dir as d; print(d())"

FROM ${BASE_IMAGE} AS runtime
# hadolint ignore=DL3008
RUN if ! command -v python3 >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends python3 \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && groupadd --gid 10001 kimi \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin kimi
COPY --from=build /opt/kimi-vision /opt/kimi-vision
ENV PATH=/opt/kimi-vision/bin:$PATH \
    KIMI_VISION_CACHE=/opt/kimi-vision/models \
    PYTHONUNBUFFERED=1
USER 10001
WORKDIR /home/kimi
# gRPC, the plaintext health port for probes, Prometheus /metrics, the OpenAI-compatible HTTP face.
EXPOSE 50051 50052 9090 8000
ENTRYPOINT ["kimi-vision", "serve"]
CMD ["--host", "0.0.0.0", "--health-port", "50052", "--metrics-port", "9090", "--log-format", "json"]
