"""Every unit of budget usable: a batch is answered up to what the remaining budget pays and
the rest marked ``budget_refused``; ``conclave query`` writes the labels it got when the budget
runs out mid-way; the ``GetBudget`` counters survive a restart on the same ledger.

Real servers on 127.0.0.1 over the shared real teacher actors (``teachers`` fixture).
"""
from __future__ import annotations

import argparse
import json

import grpc
import numpy as np
import pytest

from conclave.cluster import query_command
from conclave.cluster.client import AggregatorClient, is_budget_refusal
from conclave.privacy.accounting.charge import Neighbouring, PrivacyCharge
from conclave.privacy.accounting.filter import RenyiFilter
from conclave.privacy.accounting.ledger import PrivacyLedger
from conclave.privacy.accounting.rdp import epsilon_from_rdp
from conclave.privacy.mechanisms import SecureGNMax, build_mechanism
from tests.aggregators import DELTA, serving

ORDER, SIGMA = 16.0, 8.0
PER_ANSWER = ORDER / SIGMA**2  # GNMax's RDP at the filter's order for one answer (λ/σ²)


@pytest.fixture(scope="module")
def public(teachers) -> np.ndarray:
    from conclave.learning.data import load_digits

    return load_digits()[1].x


def room_for(answers: float) -> RenyiFilter:
    """A filter at order 16 with room for ``answers`` GNMax answers at σ = 8 (half a unit spare
    where it is x.5, so rounding cannot admit one more or one fewer)."""
    return RenyiFilter(epsilon_from_rdp([ORDER], [answers * PER_ANSWER], DELTA)[0], DELTA, ORDER)


def at_order(charge: PrivacyCharge) -> float:
    """A charge's RDP at the filters' order."""
    return float(charge.rdp[list(charge.orders).index(ORDER)])


def query(*argv: str) -> int:
    """``conclave query ...`` in-process (exit status)."""
    parser = argparse.ArgumentParser()
    query_command.add_arguments(parser, "query")
    return query_command.main(parser.parse_args(argv))


def test_a_batch_is_answered_up_to_what_the_budget_pays_and_the_rest_refused(teachers, public, tmp_path):
    budget = room_for(7.5)
    path = tmp_path / "ledger.sqlite"
    with serving(teachers, path, mechanism=build_mechanism("gnmax", sigma=SIGMA), budget=budget) as (_, address), \
            AggregatorClient(address) as client:
        first = client.label_reply(public[:4])
        assert first.answered == 4 and not first.refused.any()
        # Two inputs on record, six new of which the budget pays for three: the first three, in order.
        mixed = client.label_reply(public[2:10])
        assert (mixed.labels[:2] == first.labels[2:]).all()
        assert mixed.refused.tolist() == [False] * 5 + [True] * 3
        assert (mixed.labels[:5] >= 0).all() and (mixed.labels[5:] == -1).all() and mixed.answered == 5
        assert mixed.budget["queries_answered"] == 7 and mixed.budget["cache_hits"] == 2
        # Nothing more fits and nothing in this batch is on record: refused whole, as before.
        with pytest.raises(grpc.RpcError) as refusal:
            client.label(public[7:9])
        assert refusal.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and is_budget_refusal(refusal.value)
        assert client.budget()["queries_answered"] == 7
    with PrivacyLedger.open_existing(path) as ledger:
        report = ledger.report()
        assert len(ledger.answers.read()) == 7
    assert report.rdp_at_budget_order == pytest.approx(7 * PER_ANSWER) and report.rdp_at_budget_order <= budget.rdp_budget


def test_query_writes_the_labels_it_got_when_the_budget_runs_out_midway(teachers, public, tmp_path, capsys):
    inputs = tmp_path / "inputs.npy"
    np.save(inputs, public[:16])
    mechanism = build_mechanism("gnmax", sigma=SIGMA)
    with serving(teachers, tmp_path / "ledger.sqlite", mechanism=mechanism, budget=room_for(6.5)) as (_, address):
        # Batches of 4: the first answered, the second in part (2 of 4), the third refused whole.
        assert query(address, "--inputs", str(inputs), "--batch-size", "4") == 3
        captured = capsys.readouterr()
        labels = [int(line) for line in captured.out.split()]
        assert len(labels) == 16 and all(label >= 0 for label in labels[:6]) and labels[6:] == [-1] * 10
        stopped = [line for line in captured.err.splitlines() if "stopped" in line]
        assert len(stopped) == 1 and "stopped at input 8 of 16: privacy budget spent" in stopped[0]
        assert "labelled 6 of 16 inputs" in captured.err

        # Asked again: the six on record come back free and identical; JSON says what stopped it.
        assert query(address, "--inputs", str(inputs), "--batch-size", "4", "--json") == 3
        result = json.loads(capsys.readouterr().out)
        assert result["labels"] == labels and result["answered"] == 6
        assert result["budget_refused"] == 2 + 4 and result["not_asked"] == 4  # batch 4 never asked
        assert "privacy budget spent" in result["stopped"] and result["budget"]["queries_answered"] == 6


def test_get_budget_counters_are_restored_from_the_ledger_after_a_restart(teachers, public, tmp_path):
    path, budget = tmp_path / "ledger.sqlite", room_for(1000.0)  # one declared budget for every start
    # Six answered by GNMax, then four the confident variant abstains on (no histogram of 4
    # teachers passes a threshold of 1000), all on one ledger.
    with serving(teachers, path, mechanism=build_mechanism("gnmax", sigma=2.0), budget=budget) as (_, address), \
            AggregatorClient(address) as client:
        client.label(public[:6])
    abstaining = build_mechanism("confident-gnmax", threshold=1000.0, sigma1=1.0, sigma2=1.0)
    with serving(teachers, path, mechanism=abstaining, budget=budget) as (_, address), \
            AggregatorClient(address) as client:
        assert client.budget()["queries_answered"] == 6
        assert (client.label(public[6:10]) == -1).all()
        before = client.budget()
    with serving(teachers, path, mechanism=abstaining, budget=budget) as (_, address), \
            AggregatorClient(address) as client:
        after = client.budget()
        assert (after["queries_answered"], after["queries_abstained"]) == (6, 4) == (
            before["queries_answered"], before["queries_abstained"])
        assert after["cache_hits"] == 0 and after["epsilon_spent"] == before["epsilon_spent"]
        client.label(public[:10])  # on record: cache hits, the distinct counts unchanged
        again = client.budget()
        assert (again["queries_answered"], again["queries_abstained"], again["cache_hits"]) == (6, 4, 10)


def test_the_secure_path_answers_up_to_what_the_budget_pays(teachers, public, tmp_path):
    """``aggregation: secure``: the batch is sized before its first round, so only the rounds
    of the paid prefix run, and the ledger holds exactly their charge."""
    mechanism = SecureGNMax(SIGMA)
    two, three = (at_order(mechanism.worst_case_charge(n).for_records(Neighbouring.ADD_REMOVE,
                                                                      "one teacher per record"))
                  for n in (2, 3))
    room = (two + three) / 2  # two answers and half of a third
    budget = RenyiFilter(epsilon_from_rdp([ORDER], [room], DELTA)[0], DELTA, ORDER)
    path = tmp_path / "ledger.sqlite"
    with serving(teachers, path, mechanism=mechanism, budget=budget) as (_, address), \
            AggregatorClient(address) as client:
        reply = client.label_reply(public[:5])
        with pytest.raises(grpc.RpcError) as refusal:
            client.label(public[5:6])
        assert is_budget_refusal(refusal.value)
    with PrivacyLedger.open_existing(path) as ledger:
        report = ledger.report()
    assert reply.budget["mechanism"] == "secure-gnmax"
    assert reply.answered == 2 and reply.refused.tolist() == [False, False, True, True, True]
    assert report.charges == 1 and report.rdp_at_budget_order == pytest.approx(two)
