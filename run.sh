#!/usr/bin/env bash
# The README's two commands, each doing all of its own set-up, idempotently:
#
#   ./run.sh demo   a venv with torch and the project, then `kimi-vision demo` (the main job)
#   ./run.sh test   the same with the dev extra, then `ruff check .` and the test suite (what .ci/run runs)
#
# Set-up is skipped when the venv already holds what pyproject.toml asks for (checked by pip itself,
# without network), so a second run starts at once and a changed pyproject.toml installs again.
# Extra arguments go to pytest (`./run.sh test tests/test_deploy.py -x`) or to the demo.
# KIMI_VISION_VENV names another venv (default: .venv here); PYTHON the interpreter that makes it;
# TORCH_INDEX_URL the index torch comes from (below).
set -euo pipefail
cd "$(dirname "$0")"

# torch, installed before the project so that the project's unpinned `torch` takes this one; the
# Dockerfile installs the same (tests/test_deploy.py compares the two). From pip's configured index
# unless TORCH_INDEX_URL names another: PyPI's Linux torch is the multi-GB CUDA build, and
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu (the Dockerfile's default) gives the CPU wheel.
TORCH_VERSION=2.13.0
VENV=${KIMI_VISION_VENV:-.venv}
PYTHON=${PYTHON:-python3}

usage() { echo "usage: ./run.sh demo|test [ARGS...]" >&2; exit 2; }

# The requirements of the project with `extra`, one a line: what pip is asked to check.
requirements() {
    "$VENV/bin/python" - "$1" <<'PY'
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extra = sys.argv[1]
print("\n".join(project["dependencies"] + (project["optional-dependencies"][extra] if extra else [])))
PY
}

# True when the venv runs this checkout's code with torch and every requirement installed.
installed() {
    local extra=$1
    [ -x "$VENV/bin/python" ] && [ -x "$VENV/bin/kimi-vision" ] || return 1
    "$VENV/bin/python" -P -c 'import pathlib, service, sys; sys.exit(pathlib.Path(service.__file__).resolve().parents[1] != pathlib.Path.cwd().resolve())' 2>/dev/null || return 1
    local report
    report=$("$VENV/bin/pip" install --dry-run --no-index --quiet --report - "torch==$TORCH_VERSION" \
             -r <(requirements "$extra") 2>/dev/null) || return 1
    "$VENV/bin/python" -c 'import json, sys; sys.exit(bool(json.load(sys.stdin)["install"]))' <<<"$report"
}

setup() {
    local extra=$1
    if [ ! -x "$VENV/bin/python" ]; then
        "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || {
            echo "error: kimi-vision needs Python >= 3.11 as '$PYTHON' (set PYTHON=/path/to/python3.11+)" >&2; exit 1; }
        "$PYTHON" -m venv "$VENV" || {
            echo "error: cannot create a venv in $VENV (on Debian/Ubuntu: apt-get install python3-venv)" >&2; exit 1; }
    fi
    installed "$extra" && return 0
    echo "run.sh: installing torch $TORCH_VERSION and the project${extra:+ with [$extra]} into $VENV" >&2
    "$VENV/bin/pip" install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==$TORCH_VERSION"
    "$VENV/bin/pip" install -q -e ".${extra:+[$extra]}"
}

[ $# -ge 1 ] || usage
command=$1
shift
case "$command" in
    demo)
        setup ""
        exec "$VENV/bin/kimi-vision" demo "$@"
        ;;
    test)
        setup dev
        "$VENV/bin/ruff" check .
        set +e
        "$VENV/bin/python" -m pytest -q "$@"
        rc=$?
        set -e
        # pytest exits 5 when it collected no tests: a failure, not a pass.
        if [ "$rc" -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi
        exit "$rc"
        ;;
    *) usage ;;
esac
