# kimi-vision: the gRPC service (and its HTTP face) in a container. docs/DEPLOY.md says how to run it.
#
#   docker build -t kimi-vision:0.1.0 .                                  # CPU
#   docker build -t kimi-vision:0.1.0-cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .  # NVIDIA GPUs
#
# The install steps are the README's (and run.sh's, which CI runs): torch first, then the project;
# tests/test_deploy.py holds the two to the same steps. The tiny default checkpoint is made at build
# time, so the image serves with no volume; a real model is mounted and named with --checkpoint.

ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
# Empty: pip's configured index. For a CPU image from PyTorch's own index: .../whl/cpu.
ARG TORCH_INDEX_URL=
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# A CUDA base has no Python of its own: take the distribution's (the project needs >= 3.11), at
# the version that base's release holds.
# hadolint ignore=DL3008
RUN if ! command -v python3 >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi
RUN python3 -m venv /opt/kimi-vision
ENV PATH=/opt/kimi-vision/bin:$PATH
# Pinned, by the build argument (which hadolint cannot see through).
# hadolint ignore=DL3013
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY vision vision
COPY textcore textcore
COPY service service
# The project itself, from these sources (its dependencies are pinned by pyproject.toml's bounds).
# hadolint ignore=DL3013
RUN pip install .
# Made by the installed package (not /src's sources), where the runtime looks for it.
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
