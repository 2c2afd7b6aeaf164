"""The Python client and ``conclave query`` against a real aggregator over real teacher actors."""
from __future__ import annotations

import argparse
import contextlib
import datetime
import ipaddress
import json
from pathlib import Path

import grpc
import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from conclave.actors.aggregator import AggregatorServer, ServerSettings
from conclave.cluster import query_command
from conclave.cluster.client import AggregatorClient, encode_inputs
from conclave.learning.data import load_digits
from conclave.privacy.accounting.filter import filter_for
from conclave.privacy.accounting.ledger import PrivacyLedger
from conclave.privacy.mechanisms import build_mechanism

DELTA = 1e-5


@pytest.fixture(scope="module")
def digits():
    return load_digits()


@contextlib.contextmanager
def serving(teachers, tmp_path: Path, budget: float | None = 50.0, **settings):
    mechanism = build_mechanism("gnmax", sigma=4.0)
    planned = mechanism.worst_case_charge(1).for_records(teachers.neighbouring, teachers.neighbouring_lemma)
    ledger = PrivacyLedger(tmp_path / "ledger.sqlite", DELTA, None if budget is None else filter_for(planned, budget, DELTA))
    server = AggregatorServer(teachers, mechanism, ledger, teachers.input_shape, ServerSettings(**settings))
    try:
        yield server.start()
    finally:
        server.stop()
        ledger.close()


def query(*argv: str) -> int:
    """``conclave query ...`` in-process (exit status)."""
    parser = argparse.ArgumentParser()
    query_command.add_arguments(parser, "query")
    return query_command.main(parser.parse_args(argv))


def self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    """(cert.pem, key.pem) for localhost / 127.0.0.1, valid for a day."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


def test_label_stream_and_budget_roundtrip(teachers, digits, tmp_path):
    x = digits[1].x[:40]
    with serving(teachers, tmp_path) as address, AggregatorClient(address) as client:
        labels = client.label(x.astype(np.float64))  # floats of any width are sent as float32
        assert labels.dtype == np.int64 and labels.shape == (40,) and set(labels.tolist()) <= set(range(10))
        streamed = list(client.label_stream([x[:25], x[25:]]))
        assert (np.concatenate(streamed) == labels).all()  # cached: the same answers
        budget = client.budget()
        assert budget["queries_answered"] == 40 and budget["cache_hits"] == 40
        assert 0 < budget["epsilon_spent"] <= budget["epsilon_limit"] == 50.0
        assert budget["guarantee"]["epsilon"] == 50.0 and budget["guarantee"]["basis"] == "renyi-filter"
        assert budget["sound"] and budget["guarantee"]["unsound_reasons"] == []


def test_inputs_that_are_not_floats_are_refused_before_sending():
    with pytest.raises(TypeError, match="uint8"):
        encode_inputs(np.zeros((2, 1, 8, 8), dtype=np.uint8))


def test_tls_with_a_self_signed_certificate_and_a_token(teachers, digits, tmp_path):
    cert, key = self_signed_certificate(tmp_path)
    x = digits[1].x[:6]
    with serving(teachers, tmp_path, token="tls-token", tls_cert=str(cert), tls_key=str(key)) as address:
        with AggregatorClient(address, token="tls-token", root_cert=cert) as client:
            assert client.label(x).shape == (6,)
        with AggregatorClient(address, token="tls-token", timeout=5.0) as plaintext:
            with pytest.raises(grpc.RpcError) as refused:
                plaintext.budget()
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        with AggregatorClient(address, root_cert=cert) as no_token:
            with pytest.raises(grpc.RpcError) as refused:
                no_token.label(x)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_query_command_prints_labels_and_budget(teachers, digits, tmp_path, capsys, monkeypatch):
    inputs = tmp_path / "inputs.npy"
    np.save(inputs, digits[1].x[:30])
    monkeypatch.setenv("CONCLAVE_TOKEN", "env-token")
    with serving(teachers, tmp_path, token="env-token") as address:
        assert query(address, "--inputs", str(inputs), "--json", "--batch-size", "8") == 0
        result = json.loads(capsys.readouterr().out)
        assert len(result["labels"]) == 30 and result["answered"] == 30 and result["abstained"] == 0
        assert result["budget"]["mechanism"] == "gnmax" and result["budget"]["queries_answered"] == 30

        assert query(address, "--inputs", str(inputs)) == 0
        captured = capsys.readouterr()
        assert [int(line) for line in captured.out.split()] == result["labels"]  # cached: same answers
        assert "labelled 30 of 30 inputs" in captured.err and "gnmax" in captured.err

        assert query(address, "--inputs", str(inputs), "--token", "wrong") == 1
        assert "UNAUTHENTICATED" in capsys.readouterr().err


def test_query_command_reports_refusals_and_unreadable_inputs(teachers, digits, tmp_path, capsys):
    wrong_shape = tmp_path / "wrong.npy"
    np.save(wrong_shape, digits[1].x[:4].reshape(4, 64))
    with serving(teachers, tmp_path) as address:
        assert query(address, "--inputs", str(wrong_shape)) == 1
        assert "INVALID_ARGUMENT: wrong shape [4, 64]" in capsys.readouterr().err
        assert query(address, "--inputs", str(tmp_path / "missing.npy")) == 2
        assert "cannot read inputs" in capsys.readouterr().err


def test_query_command_json_writes_an_unlimited_budget_as_text(teachers, digits, tmp_path, capsys):
    inputs = tmp_path / "inputs.npy"
    np.save(inputs, digits[1].x[:3])
    with serving(teachers, tmp_path, budget=None) as address:
        assert query(address, "--inputs", str(inputs), "--json") == 0
        budget = json.loads(capsys.readouterr().out)["budget"]
        assert budget["epsilon_limit"] == "inf" and budget["guarantee"]["epsilon"] == "inf"
        assert budget["sound"] is False and budget["guarantee"]["basis"] == "unbounded"


def test_query_command_gives_the_class_names_of_the_config_the_server_runs(teachers, digits, tmp_path, capsys):
    names = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    source = {"format": "npz", "path": str(tmp_path / "unused.npz"), "label": "y"}  # classes given: not read
    config = tmp_path / "served.yaml"
    config.write_text(json.dumps({"pipeline": "teacher_student", "classes": names, "public": source, "test": source,
                                  "owners": [{"name": "clinic", "data": source, "records": 100}]}))
    inputs = tmp_path / "inputs.npy"
    np.save(inputs, digits[1].x[:12])
    with serving(teachers, tmp_path) as address:
        assert query(address, "--inputs", str(inputs), "--json") == 0
        labels = json.loads(capsys.readouterr().out)["labels"]
        assert query(address, "--inputs", str(inputs), "--json", "--config", str(config)) == 0
        named = json.loads(capsys.readouterr().out)
        assert named["labels"] == labels and named["classes"] == names  # the wire's indices, unchanged
        assert named["names"] == [names[label] for label in labels]
        assert query(address, "--inputs", str(inputs), "--config", str(config)) == 0
        assert capsys.readouterr().out.split() == named["names"]
        assert query(address, "--inputs", str(inputs), "--config", str(tmp_path / "missing.yaml")) == 2
        assert capsys.readouterr().err.startswith(f"conclave query: --config {tmp_path / 'missing.yaml'}: ")
