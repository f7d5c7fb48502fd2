"""protos/ holds the project's own .proto files; their protoc output is committed beside the module
that uses each (`make protos`). The committed output must describe exactly what protos/ compiles to."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from tests.conftest import ROOT

PROTOS = sorted((ROOT / "protos").rglob("*.proto"))


def test_there_are_protos() -> None:
    assert PROTOS, "protos/ holds the project's own .proto files"


def _without_json_names(fdp: descriptor_pb2.FileDescriptorProto) -> descriptor_pb2.FileDescriptorProto:
    """protoc writes each field's derived JSON name into a descriptor set but not into its Python output."""
    out = descriptor_pb2.FileDescriptorProto()
    out.CopyFrom(fdp)
    messages = list(out.message_type)
    while messages:
        m = messages.pop()
        messages.extend(m.nested_type)
        for f in m.field:
            f.ClearField("json_name")
    return out


@pytest.mark.parametrize("proto", PROTOS, ids=lambda p: str(p.relative_to(ROOT / "protos")))
def test_the_committed_output_is_what_the_proto_compiles_to(proto: Path, tmp_path: Path) -> None:
    from grpc_tools import protoc

    rel = proto.relative_to(ROOT / "protos")
    out = tmp_path / "set.pb"
    assert protoc.main(["protoc", f"-I{ROOT / 'protos'}", f"--descriptor_set_out={out}", str(rel)]) == 0
    compiled = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    module = importlib.import_module(str(rel.with_suffix("")).replace("/", ".") + "_pb2")
    committed = descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)
    assert _without_json_names(committed) == _without_json_names(compiled), (
        f"run `make protos`: {rel} changed since its output was made")
    assert (ROOT / rel.with_name(rel.stem + "_pb2.pyi")).exists()
