"""The aggregator as clients see it: a real gRPC server on 127.0.0.1 over real teacher actors.

The teachers are the shared ``teachers`` fixture (tests/conftest.py), a ``TeacherPool`` of
digits CNNs on Ray; the mechanism and ledger are the production ones. Bad requests go through the generated
stub directly, so the server (not the client library) is what refuses them.
"""
from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import ray
from google.protobuf import descriptor_pool, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from conclave.actors.aggregator import SERVICE_NAME, AggregatorActor, AggregatorServer, ServerSettings
from conclave.actors.labeller import input_keys
from conclave.cluster.client import AggregatorClient
from conclave.learning.data import load_digits
from conclave.privacy.accounting.charge import Neighbouring
from conclave.privacy.accounting.filter import RenyiFilter
from conclave.privacy.accounting.ledger import PrivacyLedger
from conclave.privacy.accounting.rdp import DEFAULT_ORDERS, epsilon_from_rdp
from conclave.privacy.mechanisms import build_mechanism
from conclave.privacy.noise import SECURE, NoisePolicy
from conclave.protos import aggregator_pb2, aggregator_pb2_grpc
from tests.aggregators import DELTA, INPUT_SHAPE, budget_for, serving



@pytest.fixture(scope="module")
def digits():
    return load_digits()


@pytest.fixture
def public(digits) -> np.ndarray:
    return digits[1].x


def tensor(array: np.ndarray, dtype: str = "float32", shape=None, data: bytes | None = None) -> aggregator_pb2.Tensor:
    return aggregator_pb2.Tensor(
        shape=list(array.shape if shape is None else shape), dtype=dtype,
        data=np.ascontiguousarray(array).tobytes() if data is None else data,
    )


def status_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def test_answers_are_the_teachers_plurality_and_cost_what_the_ledger_says(teachers, public, digits, tmp_path):
    x = public[:64]
    sharp = build_mechanism("gnmax", sigma=0.3)  # tiny noise: answers must be the plurality
    roomy = budget_for(sharp, 1e4, queries=64)
    with serving(teachers, tmp_path / "ledger.sqlite", mechanism=sharp, budget=roomy) as (server, address), AggregatorClient(
        address
    ) as client:
        labels, answered, refused, budget = client.label_reply(x)
        assert not refused.any()
        assert address.startswith("127.0.0.1:") and int(address.split(":")[1]) > 0
        assert labels.shape == (64,) and answered == 64  # GNMax always answers
        votes = teachers.votes(x)
        top2 = np.sort(votes, axis=1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] >= 2  # a gap of 2 is 6.7σ: noise cannot flip it
        assert clear.sum() >= 20
        assert (labels[clear] == votes[clear].argmax(axis=1)).all()
        assert (labels == digits[1].y[:64]).mean() > 0.6  # the teachers learned digits
        assert budget["queries_answered"] == 64 and budget["mechanism"] == "gnmax" and budget["sound"]
        # 64 GNMax answers at σ=0.3: RDP 64·λ/σ², converted as the ledger does (tight, at δ)
        expected, _ = epsilon_from_rdp(DEFAULT_ORDERS, 64 * DEFAULT_ORDERS / 0.3**2, DELTA, conversion="tight")
        assert math.isclose(budget["epsilon_spent"], expected, rel_tol=1e-9) and budget["delta"] == DELTA
        # what may be published: the budget declared in advance, on add/remove neighbours
        guarantee = budget["guarantee"]
        assert guarantee["epsilon"] == 1e4 and guarantee["basis"] == "renyi-filter"
        assert guarantee["neighbouring"] == "add-remove" and guarantee["order"] == roomy.order
        assert guarantee["unsound_reasons"] == []
        seen, mask = server.answered_votes()
        assert (seen == votes).all() and mask.all()
    with PrivacyLedger.open_existing(tmp_path / "ledger.sqlite") as reopened:
        assert math.isclose(reopened.report().epsilon_spent, budget["epsilon_spent"])


def test_without_a_budget_the_reply_says_there_is_no_guarantee(teachers, public, tmp_path):
    with serving(teachers, tmp_path / "ledger.sqlite", budget=None) as (_, address), AggregatorClient(address) as client:
        client.label(public[:4])
        budget = client.budget()
        assert budget["epsilon_spent"] > 0 and not budget["sound"]
        assert budget["guarantee"]["basis"] == "unbounded" and budget["guarantee"]["epsilon"] == math.inf
        assert "no budget was declared" in budget["guarantee"]["unsound_reasons"][0]
        assert budget["affordable_queries"] == ServerSettings().max_batch  # no budget: a whole batch


BAD_REQUESTS = {
    "wrong shape": (lambda x: tensor(x.reshape(len(x), 64)), "shape"),
    "wrong example shape": (lambda x: tensor(x[:, :, :4, :].copy()), "shape"),
    "float64": (lambda x: tensor(x.astype(np.float64), dtype="float64"), "dtype"),
    "byte length": (lambda x: tensor(x, data=x.tobytes()[:-4]), "bytes"),
    "nan": (lambda x: tensor(np.where(np.arange(x.size).reshape(x.shape) == 70, np.nan, x).astype(np.float32)), "NaN"),
    "inf": (lambda x: tensor(np.where(np.arange(x.size).reshape(x.shape) == 3, np.inf, x).astype(np.float32)), "infinity"),
    "raw bytes, not [0, 1]": (lambda x: tensor((x * 255).astype(np.float32)), "pixel values must be in [0, 1]"),
    "negative": (lambda x: tensor(x - 0.5), "pixel values must be in [0, 1]"),
    "empty batch": (lambda x: tensor(x[:0]), "empty"),
    "over max batch": (lambda x: tensor(np.concatenate([x, x[:1]])), "maximum"),
    "no tensor": (lambda x: None, "shape"),
}


def test_each_bad_input_gets_invalid_argument_and_spends_nothing(teachers, public, tmp_path):
    x = public[:8]  # max_batch is 8 here
    with serving(teachers, tmp_path / "ledger.sqlite", max_batch=8) as (server, address), grpc.insecure_channel(address) as channel:
        stub = aggregator_pb2_grpc.AggregatorStub(channel)
        stub.Label(aggregator_pb2.LabelRequest(inputs=tensor(public[100:102])))  # something spent already
        before = stub.GetBudget(aggregator_pb2.BudgetRequest())
        for case, (make, keyword) in BAD_REQUESTS.items():
            request = aggregator_pb2.LabelRequest() if make(x) is None else aggregator_pb2.LabelRequest(inputs=make(x))
            code, details = status_of(lambda: stub.Label(request))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, case
            assert keyword in details, (case, details)
            code, _ = status_of(lambda: list(stub.LabelStream(iter([request]))))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, case
        assert stub.GetBudget(aggregator_pb2.BudgetRequest()) == before
        assert len(server.answered_votes()[1]) == 2
        # GetBudget reads its request too: an empty BudgetRequest and nothing else
        get_budget = channel.unary_unary(f"/{SERVICE_NAME}/GetBudget", request_serializer=bytes,
                                         response_deserializer=aggregator_pb2.BudgetReply.FromString)
        assert get_budget(b"") == before
        for body, problem in ((b"\xff\xff\xff", "the request is not a BudgetRequest message"),
                              (aggregator_pb2.LabelRequest(inputs=tensor(x)).SerializeToString(),
                               "a BudgetRequest has no fields; this one carries")):
            code, details = status_of(lambda: get_budget(body))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(problem), details


def test_repeated_inputs_come_from_the_cache_at_no_cost(teachers, public, tmp_path):
    # σ=40 with 4 teachers: answers are close to uniform noise, so fresh noise on a repeat
    # would change most of 48 labels; the cache must return exactly the first answers.
    noisy = build_mechanism("gnmax", sigma=40.0)
    x = public[:48]
    with serving(teachers, tmp_path / "ledger.sqlite", mechanism=noisy, budget=None) as (server, address):
        with AggregatorClient(address) as client:
            first, _, _, spent = client.label_reply(x)
            again, _, _, spent_again = client.label_reply(x[::-1])
            assert (again[::-1] == first).all()
            assert spent_again["epsilon_spent"] == spent["epsilon_spent"]
            assert spent_again["queries_answered"] == 48 and spent_again["cache_hits"] == 48
            # duplicates inside one batch are charged once and answered alike
            doubled, _, _, after = client.label_reply(np.concatenate([public[200:210], public[200:210]]))
            assert (doubled[:10] == doubled[10:]).all()
            assert after["queries_answered"] == 58 and after["cache_hits"] == 58
            # the same new batch from several clients at once: answered (and charged) once
            batch = public[300:316]
            with ThreadPoolExecutor(max_workers=4) as pool:
                replies = list(pool.map(lambda _: client.label(batch), range(4)))
            assert all((reply == replies[0]).all() for reply in replies)
            final = client.budget()
            assert final["queries_answered"] == 58 + 16 and final["cache_hits"] == 58 + 3 * 16
            # -0.0 for +0.0 is the same input: the record's answers, not a second draw of the noise
            signed = x.copy()
            assert (signed == 0).sum() > 48 * 10  # digits: many zero pixels in each image
            signed[signed == 0] = -0.0
            assert np.signbit(signed).any() and signed.tobytes() != x.tobytes()
            np.testing.assert_array_equal(client.label(signed), first)
            again = client.budget()
            assert again["epsilon_spent"] == final["epsilon_spent"] and again["cache_hits"] == final["cache_hits"] + 48
        assert len(server.answered_votes()[0]) == 58 + 16


def test_an_input_key_is_canonical_in_signed_zeros_and_nan_payloads_only():
    x = np.array([[0.0, 0.5, np.nan, -1.0]], dtype=np.float32)
    spellings = np.repeat(x, 3, axis=0)
    spellings[1, 0] = -0.0
    spellings.view(np.uint32)[2, 2] = 0xFFC00123  # a NaN with another sign and payload
    assert len(set(input_keys(spellings))) == 1
    other = x.copy()
    other[0, 3] = np.nextafter(np.float32(-1.0), np.float32(0.0))  # any other change is another input
    assert input_keys(other) != input_keys(x)


def test_two_servers_release_different_noise_unless_reproducible_noise_is_asked_for(teachers, public, tmp_path):
    # σ = 40 over 4 teachers: the answers are mostly noise, so two independent runs disagree
    noisy, x = build_mechanism("gnmax", sigma=40.0), public[:48]

    def labels(noise: NoisePolicy, run: str) -> tuple[np.ndarray, dict]:
        (tmp_path / run).mkdir()
        ledger = PrivacyLedger(tmp_path / run / "ledger.sqlite", DELTA, budget_for(noisy, 50.0))
        server = AggregatorServer(teachers, noisy, ledger, INPUT_SHAPE, noise=noise)
        try:
            return server.label(x).labels, server.budget().as_dict()
        finally:
            ledger.close()

    first, budget = labels(SECURE, "a")
    second, _ = labels(SECURE, "b")
    assert (first != second).sum() > 10 and budget["sound"]
    replay = NoisePolicy(insecure_seed=3)
    again, unsound = labels(replay, "c")
    assert (again == labels(replay, "d")[0]).all()
    assert not unsound["sound"] and "insecure_noise_seed=3" in unsound["guarantee"]["unsound_reasons"][0]


def test_budget_exhaustion_stops_answers_and_the_ledger_stays_within_the_limit(teachers, public, tmp_path):
    # A filter at order 16 whose RDP budget, 20.5·16/σ², admits exactly 20 GNMax answers at
    # σ = 8 (20·16/64 RDP): 5 batches of 4, and not one input of a sixth.
    order = 16.0
    epsilon = epsilon_from_rdp([order], [20.5 * order / 8.0**2], DELTA)[0]
    budget = RenyiFilter(epsilon, DELTA, order)
    assert budget.rdp_budget == pytest.approx(20.5 * order / 64)
    with serving(teachers, tmp_path / "ledger.sqlite", mechanism=build_mechanism("gnmax", sigma=8.0), budget=budget) as (
        server, address,
    ), AggregatorClient(address) as client:
        assert client.budget()["affordable_queries"] == 20  # what GetBudget says before any call
        answered_batches = 0
        for start in range(0, 400, 4):
            try:
                reply = client.label_reply(public[start : start + 4])
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "nothing was released or charged" in err.details()
                break
            answered_batches += 1
            assert reply.budget["affordable_queries"] == 20 - 4 * answered_batches  # every reply carries it
        else:
            pytest.fail("the ledger never refused")
        assert answered_batches == 5
        at_refusal = client.budget()
        assert at_refusal["queries_answered"] == 4 * answered_batches and at_refusal["affordable_queries"] == 0
        code, _ = status_of(lambda: client.label(public[start : start + 4]))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and client.budget() == at_refusal
        # Already answered inputs are still served: from the cache, at no cost.
        assert client.label(public[:4]).shape == (4,)
        assert client.budget()["epsilon_spent"] == at_refusal["epsilon_spent"]
        assert len(server.answered_votes()[0]) == 4 * answered_batches
    with PrivacyLedger.open_existing(tmp_path / "ledger.sqlite") as reopened:
        report = reopened.report()
    assert report.rdp_at_budget_order == pytest.approx(20 * order / 64)
    assert report.rdp_at_budget_order <= budget.rdp_budget
    assert math.isclose(report.epsilon_spent, at_refusal["epsilon_spent"])
    assert at_refusal["guarantee"]["epsilon"] == pytest.approx(epsilon)  # the guarantee is the budget


def test_token_is_required_for_the_aggregator_but_not_for_health(teachers, public, tmp_path):
    with serving(teachers, tmp_path / "ledger.sqlite", token="s3cret") as (_, address):
        for token, expected in ((None, "missing"), ("wrong", "invalid")):
            with AggregatorClient(address, token=token) as client:
                for call in (lambda: client.label(public[:2]), client.budget, lambda: list(client.label_stream([public[:2]]))):
                    code, details = status_of(call)
                    assert code == grpc.StatusCode.UNAUTHENTICATED and expected in details
        with AggregatorClient(address, token="s3cret") as client:
            assert client.label(public[:2]).shape == (2,)
            assert client.budget()["queries_answered"] == 2
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="conclave.v1.Aggregator"))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_stream_answers_batches_in_order(teachers, public, tmp_path):
    batches = [public[0:3], public[10:15], public[20:27], public[0:3]]
    with serving(teachers, tmp_path / "ledger.sqlite") as (_, address), AggregatorClient(address) as client:
        streamed = list(client.label_stream(batches))
        assert [len(labels) for labels in streamed] == [3, 5, 7, 3]
        assert (streamed[3] == streamed[0]).all()
        for batch, labels in zip(batches, streamed):  # asked again: cached, so identical
            assert (client.label(batch) == labels).all()
        assert client.budget()["queries_answered"] == 15


class BrokenTeachers:
    """A vote source whose actors died: the failure path of a real deployment."""

    neighbouring, neighbouring_lemma = Neighbouring.ADD_REMOVE, "one teacher per record"
    votes_per_query, batch_coupled, num_classes, local = None, False, 10, False

    def votes(self, inputs: np.ndarray) -> np.ndarray:
        raise ConnectionError("teacher actor 3 died")

    def ready(self, timeout: float = 2.0) -> bool:
        return True  # the probe answered before the actor died: the vote is what fails


def test_health_and_unavailable_until_teachers_are_ready(teachers, public, tmp_path):
    with serving(teachers, tmp_path / "ledger.sqlite", ready=False) as (server, address), grpc.insecure_channel(address) as channel:
        assert server.answered_votes()[0].shape == (0, 10)  # nothing asked yet
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        with AggregatorClient(address) as client:
            code, _ = status_of(lambda: client.label(public[:2]))
            assert code == grpc.StatusCode.UNAVAILABLE
            server.set_ready(True)
            assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
            assert client.label(public[:2]).shape == (2,)
    with serving(BrokenTeachers(), tmp_path / "broken.sqlite") as (_, address), AggregatorClient(address) as client:
        code, details = status_of(lambda: client.label(public[:2]))
        assert code == grpc.StatusCode.UNAVAILABLE and "actor 3" not in details
        assert client.budget()["epsilon_spent"] == 0 and client.budget()["queries_answered"] == 0


def test_inputs_answered_before_are_served_from_the_record_while_the_teachers_are_down(teachers, public, tmp_path):
    with serving(teachers, tmp_path / "ledger.sqlite") as (server, address), AggregatorClient(address) as client:
        before = client.label(public[:3])
        spent = client.budget()["epsilon_spent"]
        server.set_ready(False)  # e.g. a teacher actor beyond its restarts
        np.testing.assert_array_equal(client.label(public[:3]), before)  # repeats: the ledger's answers
        assert status_of(lambda: client.label(public[:4]))[0] == grpc.StatusCode.UNAVAILABLE  # one is new
        assert client.budget()["epsilon_spent"] == spent  # nothing charged meanwhile


def test_clients_can_wait_out_unavailable(teachers, public, tmp_path):
    with serving(teachers, tmp_path / "ledger.sqlite") as (server, address):
        server.set_ready(False)  # e.g. teachers restarting: UNAVAILABLE, nothing charged
        threading.Timer(1.0, server.set_ready, (True,)).start()
        with AggregatorClient(address) as impatient:
            assert status_of(lambda: impatient.label(public[:2]))[0] == grpc.StatusCode.UNAVAILABLE
        with AggregatorClient(address, retry_unavailable=30.0) as patient:
            assert patient.label(public[:2]).shape == (2,)  # asked again once the server was back
            assert patient.budget()["queries_answered"] + patient.budget()["queries_abstained"] == 2


def test_a_client_with_only_reflection_can_call_label(teachers, public, tmp_path):
    """Everything below comes from the server: no protos.* classes are used."""
    with serving(teachers, tmp_path / "ledger.sqlite", token="t0ken") as (_, address), grpc.insecure_channel(address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        assert {"conclave.v1.Aggregator", "grpc.health.v1.Health", reflection.SERVICE_NAME} <= set(database.get_services())
        pool = descriptor_pool.DescriptorPool(database)
        service = pool.FindServiceByName("conclave.v1.Aggregator")
        method = service.FindMethodByName("Label")
        request_class = message_factory.GetMessageClass(method.input_type)
        reply_class = message_factory.GetMessageClass(method.output_type)
        assert request_class is not aggregator_pb2.LabelRequest
        x = public[:5]
        request = request_class()
        request.inputs.shape.extend(x.shape)
        request.inputs.dtype = "float32"
        request.inputs.data = x.astype("<f4").tobytes()
        label = channel.unary_unary(
            f"/{service.full_name}/{method.name}",
            request_serializer=lambda message: message.SerializeToString(),
            response_deserializer=reply_class.FromString,
        )
        reply = label(request, metadata=(("authorization", "Bearer t0ken"),))
        assert len(reply.labels) == 5 and reply.answered == 5 and reply.budget.queries_answered == 5
        assert all(0 <= label < 10 for label in reply.labels)


def test_aggregator_actor_serves_from_inside_ray(teachers, public, tmp_path):
    ledger_path = tmp_path / "actor-ledger.sqlite"
    mechanism = build_mechanism("gnmax", sigma=2.0)
    actor = AggregatorActor.remote(
        teachers, mechanism, str(ledger_path), DELTA, budget_for(mechanism, 20.0), INPUT_SHAPE,
        ServerSettings(token="actor-token"),
    )
    try:
        address = ray.get(actor.start.remote())
        with AggregatorClient(address, token="actor-token") as client:
            labels = client.label(public[:12])
            assert labels.shape == (12,) and client.budget()["queries_answered"] == 12
        votes, mask = ray.get(actor.answered_votes.remote())
        assert votes.shape == (12, 10) and mask.all()
        assert ray.get(actor.budget.remote())["epsilon_spent"] > 0
    finally:
        ray.get(actor.stop.remote())
        ray.kill(actor)
    with PrivacyLedger.open_existing(ledger_path) as reopened:
        assert reopened.report().charges == 1 and reopened.report().budget.epsilon == 20.0


def test_table_inputs_are_checked_against_their_schema_not_the_pixel_range():
    from conclave.actors.labeller import InvalidInput, decode_inputs
    from conclave.learning.data.schema import InputSchema

    schema = InputSchema.for_shape((3,))
    rows = np.array([[120.0, -4.5, 1e4], [0.0, 0.0, 0.0]], dtype="<f4")
    decoded = decode_inputs((2, 3), "float32", rows.tobytes(), schema, max_batch=8)
    np.testing.assert_array_equal(decoded, rows)
    with pytest.raises(InvalidInput, match=r"wrong shape \[2, 4\]: inputs must have shape \[batch, 3\]"):
        decode_inputs((2, 4), "float32", np.zeros((2, 4), "<f4").tobytes(), schema, max_batch=8)
    rows[1, 2] = np.inf
    with pytest.raises(InvalidInput, match=r"NaN or infinity \(examples \[1\]\)"):
        decode_inputs((2, 3), "float32", rows.tobytes(), schema, max_batch=8)
    bounded = InputSchema((3,), "table", -1.0, 1.0)
    with pytest.raises(InvalidInput, match=r"values must be in \[-1, 1\] \(examples \[0\]"):
        decode_inputs((1, 3), "float32", np.array([[2.0, 0, 0]], "<f4").tobytes(), bounded, max_batch=8)


def test_a_second_server_on_a_port_another_holds_fails_in_one_line(tmp_path):
    # gRPC would share the port (SO_REUSEPORT) and split the clients between two servers.
    with serving(BrokenTeachers(), tmp_path / "first.sqlite") as (_, address):
        port = int(address.rsplit(":", 1)[1])
        with PrivacyLedger(tmp_path / "second.sqlite", DELTA) as ledger:
            second = AggregatorServer(BrokenTeachers(), build_mechanism("gnmax", sigma=2.0), ledger, INPUT_SHAPE,
                                      ServerSettings(port=port))
            with pytest.raises(OSError) as err:
                second.start()
        assert str(err.value) == (f"could not bind the aggregator to 127.0.0.1:{port}: the address is in use or "
                                  "not on this host")
        with grpc.insecure_channel(address) as channel:  # the first keeps its port and its clients
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
