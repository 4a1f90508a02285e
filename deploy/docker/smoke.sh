#!/usr/bin/env bash
# Build the CPU image and run it as the Kubernetes CPU Deployment runs it: uid 10001, read-only root,
# /tmp a tmpfs, every capability dropped, no new privileges, 1 GiB /dev/shm, and a CPU quota (1 CPU).
# Then, from a second container of the same image (as the node's probes and the Services reach a
# pod): gRPC health SERVING on the main and the plaintext health port, one Embed, one HTTP chat
# completion, /metrics. Checks that the image holds no NVIDIA library and no triton, that every
# line the server wrote (stdout and stderr) is JSON, that its thread defaults follow the quota, and
# that `docker stop` takes under 5 s; prints the image's size and the stop time.
#
#   deploy/docker/smoke.sh BASE_IMAGE [DOCKER BUILD OPTIONS...]
#
# BASE_IMAGE: what the Dockerfile's BASE_IMAGE names (python:3.11-slim-bookworm with registry
# access; docs/DEPLOY.md says how to make a stand-in without). The options go to `docker build`
# as they are (--secret id=ca,src=..., --build-arg ...). DOCKER: the client (default docker);
# TAG: the image's name (default kimi-vision:smoke). Exit 1 on the first failed check.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 BASE_IMAGE [DOCKER BUILD OPTIONS...]" >&2; exit 2; }
base=$1
shift
cd "$(dirname "$0")/../.."
DOCKER=${DOCKER:-docker}
TAG=${TAG:-kimi-vision:smoke}
CPUS=1
MAX_IMAGE_BYTES=1800000000  # the CPU image's budget (1.8 GB)
MAX_STOP_S=5
name=kimi-vision-smoke-$$

fail() { echo "FAIL: $*" >&2; exit 1; }
check() { "$DOCKER" run --rm -i --entrypoint python "$@"; }  # the image's Python, reading smoke_check.py
cleanup() { "$DOCKER" rm -f "$name" >/dev/null 2>&1 || true; }
trap cleanup EXIT

echo "== build $TAG on $base"
DOCKER_BUILDKIT=1 "$DOCKER" build -t "$TAG" --build-arg BASE_IMAGE="$base" "$@" .
size=$("$DOCKER" image inspect -f '{{.Size}}' "$TAG")

echo "== what the image holds"
nvidia=$("$DOCKER" run --rm --user 0 --entrypoint find "$TAG" / -xdev \
    \( -iname "*nvidia*" -o -name "libcu*.so*" -o -name "libnccl*" -o -name "libcudnn*" \) -print)
[ -z "$nvidia" ] || fail "the CPU image holds NVIDIA libraries: $(echo "$nvidia" | head -5)"
"$DOCKER" run --rm --entrypoint python "$TAG" -c 'import importlib.util as u, sys, torch
sys.exit("triton is installed" if u.find_spec("triton") else "torch is a CUDA build" if torch.version.cuda else 0)' \
    || fail "not a CPU image"
echo "ok: no NVIDIA library, no triton, torch CPU build"
[ "$size" -le "$MAX_IMAGE_BYTES" ] || fail "image is $size bytes, over the CPU budget of $MAX_IMAGE_BYTES"

echo "== run as the Deployment does"
"$DOCKER" run -d --name "$name" --user 10001:10001 --read-only --tmpfs /tmp:rw,exec,nosuid,size=1g \
    --cap-drop ALL --security-opt no-new-privileges --shm-size 1g --cpus "$CPUS" -e HOME=/tmp "$TAG" \
    --host 0.0.0.0 --port 50051 --health-port 50052 --metrics-port 9090 --log-format json --drain-seconds 30 \
    --devices cpu:2 --http-port 8000 >/dev/null
address=$("$DOCKER" inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$name")
check "$TAG" - serve "$address" < deploy/docker/smoke_check.py \
    || { "$DOCKER" logs --tail 40 "$name" >&2 || true; fail "the server does not serve"; }

echo "== docker stop"
start=$(date +%s.%N)
"$DOCKER" stop -t 45 "$name" >/dev/null
stop_s=$(echo "$start $(date +%s.%N)" | awk '{printf "%.2f", $2 - $1}')
code=$("$DOCKER" inspect -f '{{.State.ExitCode}}' "$name")
[ "$code" = 0 ] || fail "the server exited $code on SIGTERM"
awk -v s="$stop_s" -v m="$MAX_STOP_S" 'BEGIN {exit !(s < m)}' || fail "docker stop took $stop_s s (limit $MAX_STOP_S s)"
echo "ok: stopped in $stop_s s, exit 0"
"$DOCKER" logs "$name" 2>&1 | check "$TAG" -c "$(cat deploy/docker/smoke_check.py)" logs "$CPUS"

echo "== passed: image $TAG $size bytes ($(awk -v b="$size" 'BEGIN {printf "%.2f", b / 1e9}') GB), docker stop $stop_s s"
