"""An active coordinator against the owners' gateways, through the gateways' own API (real gRPC over
mutual TLS, real Ray, real ledgers): every attempt is refused in one line with its status code,
and no owner's ledger gains a charge."""
from __future__ import annotations

import contextlib
import itertools
import pickle
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from conclave.cluster.gateway.client import ClusterVotes, GatewayVoteSource, float_tensor
from conclave.cluster.gateway.identity import Identity, RoundKey
from conclave.cluster.gateway.vote_runs import signed_round_key
from conclave.cluster.tls import issue, load_authority
from conclave.protos import owner_pb2
from tests.gateways import CLASSES, OWNERS, Consortium, gateways_serving, make_consortium

RUN, SIGMA, BATCH = "attack", 10.0, 8
Code = grpc.StatusCode


@dataclass
class Attack:
    consortium: Consortium
    stubs: dict
    rounds: itertools.count

    def keys(self, round_: int, owners=OWNERS) -> list[owner_pb2.SignedKey]:
        return [self.stubs[owner].Keys(owner_pb2.KeysRequest(run=RUN, round=round_, batch=BATCH), timeout=30)
                for owner in owners]

    def votes(self, owner: str, round_: int, parties, inputs: owner_pb2.Tensor | None = None) -> owner_pb2.VotesReply:
        inputs = inputs or float_tensor(self.consortium.queries[:BATCH])
        request = owner_pb2.VotesRequest(run=RUN, round=round_, inputs=inputs, parties=parties)
        return self.stubs[owner].Votes(request, timeout=30)


@pytest.fixture(scope="module")
def attack(ray_session, tmp_path_factory):
    directory = tmp_path_factory.mktemp("attacked")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CONCLAVE_HOME", str(directory / "home"))
        with gateways_serving(make_consortium(directory)) as consortium:
            source = GatewayVoteSource([consortium.gateway(owner) for owner in OWNERS], consortium.verifier, RUN,
                                       ClusterVotes(3, "flatten", 64), "public-clusters", SIGMA, CLASSES,
                                       consortium.public, max_batch=BATCH, rounds=40)
            channels = {owner: consortium.stub(owner) for owner in OWNERS}
            try:
                yield Attack(consortium, {owner: stub for owner, (_, stub) in channels.items()}, itertools.count(1))
            finally:
                for channel, _ in channels.values():
                    channel.close()
                source.shutdown()


@contextlib.contextmanager
def refused(attack: Attack, code: grpc.StatusCode, *words: str):
    """The call inside is refused with ``code``, in one line naming the problem, and nothing is charged."""
    before = {owner: attack.consortium.charges(owner) for owner in OWNERS}
    with pytest.raises(grpc.RpcError) as caught:
        yield
    error = caught.value
    assert error.code() == code, (error.code(), error.details())
    assert "\n" not in error.details() and all(word in error.details() for word in words), error.details()
    assert {owner: attack.consortium.charges(owner) for owner in OWNERS} == before


def admit_request(attack: Attack, run: str, **changes) -> owner_pb2.AdmitRequest:
    request = owner_pb2.AdmitRequest(run=run, mechanism="public-clusters", sigma=SIGMA, max_batch=BATCH, rounds=4,
                                     classes=list(CLASSES), public_pool=float_tensor(attack.consortium.public),
                                     clusters=owner_pb2.ClusterTerms(votes_per_record=3, embedding="flatten", dims=64))
    for name, value in changes.items():
        if isinstance(value, owner_pb2.Tensor | owner_pb2.ClusterTerms | owner_pb2.KnnTerms):
            getattr(request, name).CopyFrom(value)
        elif isinstance(value, list):
            del getattr(request, name)[:]
            getattr(request, name).extend(value)
        else:
            setattr(request, name, value)
    return request


def test_an_honest_round_answers_and_charges_each_owner_once(attack):
    round_ = next(attack.rounds)
    before = {owner: attack.consortium.charges(owner) for owner in OWNERS}
    keys = attack.keys(round_)
    replies = [attack.votes(owner, round_, keys) for owner in OWNERS]
    assert all(reply.share.dtype == "int64" and reply.charges == before[owner] + 1
               for owner, reply in zip(OWNERS, replies))
    assert {owner: attack.consortium.charges(owner) for owner in OWNERS} == {o: n + 1 for o, n in before.items()}
    with refused(attack, Code.FAILED_PRECONDITION, "one round"):  # a second Votes for the same round
        attack.votes("hospital_a", round_, keys)


@pytest.mark.parametrize("method", ["Neighbours", "Distances", "PartialVotes", "Histogram"])
def test_no_call_gives_distances_neighbours_or_an_owners_histogram(attack, method):
    channel, _ = attack.consortium.stub("hospital_a")
    with channel, refused(attack, Code.UNIMPLEMENTED):
        channel.unary_unary(f"/conclave.owner.Owner/{method}")(b"", timeout=30)


def test_a_runtime_env_smuggled_into_admit_is_refused(attack):
    smuggled = b"runtime_env: {env_vars: {HOME: /tmp/elsewhere, CONCLAVE_HOME: /tmp/shadow}}"
    payload = admit_request(attack, "smuggler").SerializeToString() + bytes([0xBA, 0x06, len(smuggled)]) + smuggled
    channel, _ = attack.consortium.stub("hospital_a")
    with channel, refused(attack, Code.INVALID_ARGUMENT, "does not declare", "runtime_env"):
        channel.unary_unary("/conclave.owner.Owner/Admit")(payload, timeout=30)


def test_pickled_objects_are_never_unpickled(attack):
    pickled = owner_pb2.Tensor(shape=[1, 1], dtype="object", data=pickle.dumps({"__reduce__": "os.system"}))
    with refused(attack, Code.INVALID_ARGUMENT, "dtype"):
        attack.stubs["hospital_a"].Admit(admit_request(attack, "pickler", public_pool=pickled), timeout=30)
    round_ = next(attack.rounds)
    with refused(attack, Code.INVALID_ARGUMENT, "dtype"):
        attack.votes("hospital_a", round_, attack.keys(round_), inputs=pickled)
    round_ = next(attack.rounds)
    bytes_as_floats = owner_pb2.Tensor(shape=[BATCH, 1, 8, 8], dtype="float32", data=pickle.dumps(list(range(50))))
    with refused(attack, Code.INVALID_ARGUMENT, "bytes"):
        attack.votes("hospital_a", round_, attack.keys(round_), inputs=bytes_as_floats)


@pytest.mark.parametrize("changes, code, words", [
    ({"clusters": owner_pb2.ClusterTerms(votes_per_record=3, embedding="os:system", dims=8)},
     Code.PERMISSION_DENIED, ("embedding", "not registered")),
    ({"clusters": owner_pb2.ClusterTerms(votes_per_record=3, embedding="network:/tmp/model.pt", dims=8)},
     Code.PERMISSION_DENIED, ("embedding",)),
    ({"mechanism": "gnmax"}, Code.PERMISSION_DENIED, ("mechanism", "not registered")),
    ({"mechanism": "my.module:Mechanism"}, Code.PERMISSION_DENIED, ("mechanism",)),
    ({"sigma": 0.3}, Code.PERMISSION_DENIED, ("at most ε 10 per run",)),
    ({"lifetime_epsilon": 100.0}, Code.PERMISSION_DENIED, ("more than the ε 30",)),
    ({"classes": ["0"]}, Code.INVALID_ARGUMENT, ("classes",)),
])
def test_terms_outside_the_registry_or_the_policy_are_refused(attack, changes, code, words):
    request = admit_request(attack, f"outside-{sorted(changes)[0]}-{next(attack.rounds)}", **changes)
    with refused(attack, code, *words):
        attack.stubs["hospital_a"].Admit(request, timeout=30)
    # The admitted run goes on: a refused Admit changed nothing.
    round_ = next(attack.rounds)
    assert attack.stubs["hospital_a"].Keys(owner_pb2.KeysRequest(run=RUN, round=round_, batch=BATCH), timeout=30)


def test_an_admit_without_a_vote_source_is_refused(attack):
    request = admit_request(attack, "sourceless")
    request.ClearField("clusters")
    with refused(attack, Code.INVALID_ARGUMENT, "vote source"):
        attack.stubs["hospital_a"].Admit(request, timeout=30)


def test_swapped_keys_are_refused(attack):
    round_ = next(attack.rounds)
    keys = attack.keys(round_)
    keys[1].public_key = X25519PrivateKey.generate().public_key().public_bytes_raw()  # the coordinator's own key
    with refused(attack, Code.PERMISSION_DENIED, "hospital_b", "not signed"):
        attack.votes("hospital_a", round_, keys)

    round_ = next(attack.rounds)
    keys = attack.keys(round_)
    keys[1].signature = b""
    with refused(attack, Code.PERMISSION_DENIED, "hospital_b"):
        attack.votes("hospital_a", round_, keys)

    earlier = attack.keys(next(attack.rounds))
    round_ = next(attack.rounds)
    keys = attack.keys(round_)
    keys[2].CopyFrom(earlier[2])  # hospital_c's key of another round, properly signed
    with refused(attack, Code.PERMISSION_DENIED, "hospital_c", "another round"):
        attack.votes("hospital_a", round_, keys)

    round_ = next(attack.rounds)
    keys = attack.keys(round_)
    keys[0].cell_bound = 1  # its own key, altered: another plan
    with refused(attack, Code.PERMISSION_DENIED, "hospital_a"):
        attack.votes("hospital_a", round_, keys)


def test_replayed_rounds_and_keys_are_refused(attack):
    round_ = next(attack.rounds)
    keys = attack.keys(round_)
    with refused(attack, Code.FAILED_PRECONDITION, f"round {round_}", "keyed once"):
        attack.keys(round_, owners=("hospital_a",))
    with refused(attack, Code.FAILED_PRECONDITION, "keyed once"):
        attack.keys(round_ - 3, owners=("hospital_a",))
    with refused(attack, Code.FAILED_PRECONDITION, "one round"):
        attack.votes("hospital_a", round_ + 1, keys)  # a round this gateway never keyed
    with refused(attack, Code.PERMISSION_DENIED, "not admitted"):
        attack.stubs["hospital_a"].Keys(owner_pb2.KeysRequest(run="another-run", round=1, batch=BATCH), timeout=30)


def test_a_party_outside_the_declared_peers_is_refused(attack, tmp_path):
    authority = load_authority(attack.consortium.directory / "ca")
    mallory = issue(authority, tmp_path / "mallory", ("127.0.0.1",), name="mallory", days=1, common_name="mallory")
    identity = Identity(mallory.certificate, mallory.key)
    round_ = next(attack.rounds)
    keys = attack.keys(round_)[:2]
    outsider = RoundKey("mallory", X25519PrivateKey.generate().public_key().public_bytes_raw(), 400, RUN, round_, BATCH,
                        len(CLASSES), SIGMA)
    with refused(attack, Code.PERMISSION_DENIED, "mallory", "not a declared peer"):
        forged = signed_round_key(outsider, identity.certificate_pem, identity.sign(outsider))
        attack.votes("hospital_a", round_, [*keys, forged])

    round_ = next(attack.rounds)
    keys = attack.keys(round_)[:2]
    posing = RoundKey("hospital_c", X25519PrivateKey.generate().public_key().public_bytes_raw(), 400, RUN, round_,
                      BATCH, len(CLASSES), SIGMA)  # mallory's certificate, claiming hospital_c
    with refused(attack, Code.PERMISSION_DENIED, "claims owner hospital_c"):
        forged = signed_round_key(posing, identity.certificate_pem, identity.sign(posing))
        attack.votes("hospital_a", round_, [*keys, forged])

    round_ = next(attack.rounds)
    keys = attack.keys(round_)
    with refused(attack, Code.PERMISSION_DENIED, "twice"):
        attack.votes("hospital_a", round_, [keys[0], keys[1], keys[1]])


def test_a_run_whose_first_round_the_lifetime_it_asked_cannot_pay_is_refused_before_it_starts(attack):
    # Last: a refused Admit ends the run above at hospital_a (it was admitted until the ledger was opened).
    stub = attack.stubs["hospital_a"]
    with refused(attack, Code.RESOURCE_EXHAUSTED, "hospital_a", "within ε 0.2", "nothing was admitted or charged"):
        stub.Admit(admit_request(attack, "capped", lifetime_epsilon=0.2), timeout=120)
    assert not np.isnan(stub.Budget(owner_pb2.BudgetRequest(), timeout=30).epsilon_spent)
