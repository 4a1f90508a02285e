"""The checked-in generated code under service/rpc/_proto must match proto/kimi/vision/v1/vision.proto."""

import importlib.util

from conftest import REPO_ROOT


def _load_generator():
    spec = importlib.util.spec_from_file_location("proto_generate", REPO_ROOT / "proto" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_current(tmp_path):
    generator = _load_generator()
    fresh = generator.generate(tmp_path)
    checked_in = REPO_ROOT / "service" / "rpc" / "_proto"
    stale = [p.name for p in fresh if (checked_in / p.name).read_bytes() != p.read_bytes()]
    assert not stale, f"service/rpc/_proto is stale ({', '.join(stale)}): run `python proto/generate.py`"


def test_service_descriptor_has_the_fixed_names():
    from service.rpc._proto import vision_pb2

    service = vision_pb2.DESCRIPTOR.services_by_name["VisionService"]
    assert service.full_name == "kimi.vision.v1.VisionService"
    assert {m.name for m in service.methods} == {"Preprocess", "CountTokens", "Embed", "Generate", "Encode",
                                                  "GetModelInfo"}
    assert [f.name for f in vision_pb2.Tensor.DESCRIPTOR.fields] == ["dtype", "shape", "data"]
