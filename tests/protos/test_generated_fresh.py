"""The checked-in gRPC modules must match what ``make proto`` generates from the proto now."""
from __future__ import annotations

from pathlib import Path

from conclave.protos import generate


def test_checked_in_modules_match_a_fresh_generation(tmp_path: Path) -> None:
    written = generate.generate(tmp_path)
    assert sorted(path.name for path in written) == sorted(generate.generated_names())
    stale = [
        path.name
        for path in written
        if path.read_bytes() != (generate.PROTOS_DIR / path.name).read_bytes()
    ]
    assert not stale, f"stale generated modules {stale}: run `make proto` and commit them"


def test_generated_modules_import_as_a_package() -> None:
    from conclave.protos import aggregator_pb2, aggregator_pb2_grpc

    service = aggregator_pb2.DESCRIPTOR.services_by_name["Aggregator"]
    assert service.full_name == "conclave.v1.Aggregator"
    assert [method.name for method in service.methods] == ["Label", "LabelStream", "GetBudget"]
    assert hasattr(aggregator_pb2_grpc, "AggregatorStub")
