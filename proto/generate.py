"""Regenerate the checked-in Python code for `proto/kimi/vision/v1/vision.proto`.

    python proto/generate.py            # writes service/rpc/_proto/
    python proto/generate.py --out DIR  # writes elsewhere (the staleness test compares the two)

protoc names the generated modules after the proto's package path (`kimi/vision/v1/...`); we
flatten them into `service/rpc/_proto/` and make the stub import its messages relatively, so the
code imports as `service.rpc._proto.vision_pb2` without touching sys.path. The descriptor keeps its
real file name, which is what server reflection reports.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent
PROTO_FILE = "kimi/vision/v1/vision.proto"
DEFAULT_OUT = REPO_ROOT / "service" / "rpc" / "_proto"
GENERATED = ("vision_pb2.py", "vision_pb2.pyi", "vision_pb2_grpc.py")
INIT_TEXT = '"""Generated from proto/kimi/vision/v1/vision.proto by proto/generate.py; do not edit."""\n'


def generate(out_dir: Path) -> list[Path]:
    """Run protoc and write the flattened modules (plus `__init__.py`) into `out_dir`."""
    from grpc_tools import protoc

    include = Path(protoc.__file__).resolve().parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        rc = protoc.main([
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            str(PROTO_ROOT / PROTO_FILE),
        ])
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}")
        produced = Path(tmp) / Path(PROTO_FILE).parent
        written = []
        for name in GENERATED:
            text = (produced / name).read_text()
            if name == "vision_pb2_grpc.py":
                text = text.replace("from kimi.vision.v1 import vision_pb2", "from . import vision_pb2")
            target = out_dir / name
            target.write_text(text)
            written.append(target)
    init = out_dir / "__init__.py"
    init.write_text(INIT_TEXT)
    return [init, *written]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: service/rpc/_proto)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
