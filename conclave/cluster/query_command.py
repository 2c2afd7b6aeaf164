"""``conclave query ADDRESS --inputs X.npy``: ask a running aggregator to label inputs.

Prints one label per line on stdout (-1 = the teachers abstained, or no label: refused or not
asked) and a one-line budget summary on stderr; ``--json`` prints labels, counts and the budget
as one JSON object. Labels travel as class indices; ``--config`` (the run config the server was
started with) prints the class names instead — the config's ``classes``, else its test labels',
read here as the server reads them (public data) — and ``--json`` then adds ``classes`` and
``names``. The server answers a batch up to what the budget pays and marks the rest
refused. When a call fails (the budget refuses a whole batch, or any other error) the query
stops there, still writes every label it got (one line per input), and says on stderr, in one
line, why it stopped. Exit status: 0 answered, 1 the server refused (status code and reason on
stderr), 2 the inputs could not be read, 3 the privacy budget refused some inputs (nothing was
charged for them; inputs answered before are answered again, free).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import grpc
import numpy as np

from conclave.cluster.client import AggregatorClient, is_budget_refusal
from conclave.errors import ConclaveError, fail

TOKEN_ENV = "CONCLAVE_TOKEN"
PREFIX = "conclave query"  # of every line this command ends with


class UnreadableInputs(ConclaveError):
    """The inputs, an argument or ``--config`` cannot be used: nothing was asked."""

    exit_code = 2


class ServerRefused(ConclaveError):
    """The server refused a call for another reason than the budget (its status code and reason)."""

    exit_code = 1


class BudgetSpent(ConclaveError):
    """The privacy budget refused some inputs: nothing was charged for them."""

    exit_code = 3


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("address", help="aggregator address, e.g. 127.0.0.1:50051 (printed by `conclave serve`)")
    parser.add_argument("--inputs", required=True, help=".npy file: float array [n, *input_shape], scaled like the training data")
    parser.add_argument("--token", default=None, help=f"bearer token (default: ${TOKEN_ENV})")
    parser.add_argument("--root-cert", default=None, help="PEM certificate to trust: connect with TLS")
    parser.add_argument("--client-cert", default=None, help="PEM client certificate, for a server that asks for mutual TLS")
    parser.add_argument("--client-key", default=None, help="PEM key of --client-cert")
    parser.add_argument("--batch-size", type=int, default=256, help="inputs per request (default 256)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for a single request")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of one label per line")
    parser.add_argument("--config", default=None,
                        help="the config the server runs (conclave serve CONFIG): print its class names, not indices")


def main(args: argparse.Namespace) -> int:
    try:
        inputs = _inputs(args)
    except UnreadableInputs as err:
        return fail(err, PREFIX)
    try:
        classes = None if args.config is None else class_names(args.config)
    except (ValueError, OSError) as err:  # ConfigError is a ValueError
        return fail(UnreadableInputs(f"--config {args.config}: {str(err).strip().splitlines()[0]}"), PREFIX)
    token = args.token or os.environ.get(TOKEN_ENV) or None
    batches = [inputs[start : start + args.batch_size] for start in range(0, len(inputs), args.batch_size)]
    labels = np.full(len(inputs), -1, dtype=np.int64)  # -1 until answered
    refused = np.zeros(len(inputs), dtype=bool)
    try:
        client = AggregatorClient(args.address, token=token, root_cert=args.root_cert, timeout=args.timeout,
                                  client_cert=args.client_cert, client_key=args.client_key)
    except (OSError, ValueError) as err:
        return fail(UnreadableInputs(str(err)), PREFIX)
    done, stopped, status = 0, None, 0
    with client:
        try:
            for result in ([client.label_reply(batches[0])] if len(batches) == 1
                           else client.label_stream_replies(batches)):
                labels[done : done + len(result.labels)] = result.labels
                refused[done : done + len(result.labels)] = result.refused
                done += len(result.labels)
        except grpc.RpcError as err:
            spent = is_budget_refusal(err)
            if spent:  # the whole batch was refused: nothing in it was charged
                refused[done : done + args.batch_size] = True
            stopped = (f"stopped at input {done} of {len(inputs)}: "
                       f"{'privacy budget spent' if spent else err.code().name}: {err.details()}")
            status = BudgetSpent.exit_code if spent else ServerRefused.exit_code
        budget = None
        if done:
            try:
                budget = client.budget()
            except grpc.RpcError as err:  # the labels got are still written
                stopped = stopped or f"GetBudget failed after every input was asked: {err.code().name}: {err.details()}"
                status = status or ServerRefused.exit_code
    if stopped is not None and not done:  # nothing was answered: the reason is all there is to say
        print(f"{PREFIX}: {stopped}", file=sys.stderr)
        return status

    labelled = int((labels >= 0).sum())
    abstained = done - labelled - int(refused[:done].sum())
    names = None if classes is None else [_name(classes, label) for label in labels.tolist()]
    if args.json:
        print(json.dumps({
            "labels": labels.tolist(),
            **({} if classes is None else {"classes": list(classes), "names": names}),
            "answered": labelled,
            "abstained": abstained,
            "budget_refused": int(refused.sum()),
            "not_asked": int(len(inputs) - done - refused[done:].sum()),
            "stopped": stopped,
            "budget": None if budget is None else _finite_or_text(budget),
        }))
    else:
        shown = labels.tolist() if names is None else [n if n is not None else -1 for n in names]
        print("\n".join(str(label) for label in shown))
        print(f"labelled {labelled} of {len(labels)} inputs ({abstained} abstained"
              f"{f', {int(refused.sum())} refused: privacy budget spent' if refused.any() else ''})"
              f"{'' if budget is None else '; ' + _budget_line(budget)}", file=sys.stderr)
    if stopped is not None:
        print(f"{PREFIX}: {stopped} (every label got is written, -1 where none; asking again for "
              "them costs nothing: the server keeps its answers)", file=sys.stderr)
        return status
    return BudgetSpent.exit_code if refused.any() else 0


def _inputs(args: argparse.Namespace) -> np.ndarray:
    """The inputs to ask about, checked (``UnreadableInputs``, one line, before anything is asked)."""
    if args.batch_size < 1:
        raise UnreadableInputs("--batch-size must be at least 1")
    try:
        inputs = np.load(Path(args.inputs), allow_pickle=False)
    except (OSError, ValueError) as err:
        raise UnreadableInputs(f"cannot read inputs {args.inputs}: {err}") from None
    if inputs.ndim < 1 or len(inputs) == 0:
        raise UnreadableInputs(f"{args.inputs} holds no inputs (shape {list(inputs.shape)})")
    if not np.issubdtype(inputs.dtype, np.floating):
        raise UnreadableInputs(f"{args.inputs} has dtype {inputs.dtype}; expected floats scaled like the training data")
    return inputs


def class_names(config_path: str) -> tuple[str, ...] | None:
    """The class names of the run config at ``config_path``, in the order of the indices the
    server answers with: its ``classes``, else its test labels' (``PublicData.read``, as the
    server reads them); None for a benchmark's data, whose class index is its name."""
    from conclave.cluster.config import ConfigError, load_yaml
    from conclave.cluster.owners import PublicData
    from conclave.cluster.pipelines import load_pipeline

    pipeline = load_pipeline(load_yaml(config_path))
    if pipeline.name != "teacher_student":
        raise ConfigError(f"a {pipeline.name} run serves no labels; conclave serve runs teacher_student configs")
    declared = pipeline.owners_data()
    if declared.classes:
        return tuple(declared.classes)
    if not declared.owners:
        return None
    return PublicData.read(declared.public, declared.test, None).classes


def _name(classes: tuple[str, ...], label: int) -> str | None:
    return classes[label] if 0 <= label < len(classes) else None


def _budget_line(budget: dict) -> str:
    guarantee = budget["guarantee"]
    return (f"guarantee ε = {guarantee['epsilon']:.4g} at δ = {guarantee['delta']:g} ({guarantee['basis']}); "
            f"realised spend ε = {budget['epsilon_spent']:.4g} ({budget['mechanism']}"
            f"{'' if budget['sound'] else '; NOT a sound DP guarantee: ' + '; '.join(guarantee['unsound_reasons'])})")


def _finite_or_text(value: object) -> object:
    """JSON has no infinity: write it as the string "inf" (as results/ files do), also nested."""
    if isinstance(value, dict):
        return {key: _finite_or_text(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite_or_text(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
