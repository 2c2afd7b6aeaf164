"""The layers import one way, with no cycle: privacy ← learning ← actors ← cluster's library ←
its clients (the CLI and each of its commands, tuning, the benchmarks), and no client imports
another: what two clients share lives in the library (the pipelines, ``cluster.api``). Tuning
and the benchmarks reach actors/ and cluster/ only through its front door (``FRONT_DOOR``).

Every ``import`` counts, at module level or inside a function: a cycle through a lazy import is
still a cycle a reader has to untangle.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("privacy", "learning", "actors", "cluster", "tuning", "protos")
LAYERS = ("privacy", "learning", "actors", "cluster", "tuning")  # each may import only those before it
# cluster's clients: what a user runs (the CLI and its commands); tuning and the benchmarks are clients too.
CLIENTS = ("conclave.cluster.cli",)
COMMAND_SUFFIX = "_command"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[0] in FOLDERS:
        parts = ("conclave", *parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, Path]:
    found = {}
    for top in (*FOLDERS, "conclave", "bench"):
        for path in (ROOT / top).rglob("*.py"):
            found[module_name(path)] = path
    return found


MODULES = sources()


def imports_of(name: str) -> set[str]:
    """The project modules ``name`` imports (``from pkg import sub`` counts ``pkg.sub`` when it is a module)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in MODULES and t != name)
    return found


GRAPH = {name: imports_of(name) for name in MODULES}


def layer(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if parts[0] == "conclave" and len(parts) > 1 and parts[1] in LAYERS else None


def within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == package or name.startswith(package + ".") for package in packages)


def is_client(name: str) -> bool:
    return (within(name, CLIENTS + ("conclave.tuning", "bench", "conclave.__main__"))
            or name.rpartition(".")[2].endswith(COMMAND_SUFFIX))


def client_of(name: str) -> str:
    """Which client ``name`` belongs to: tuning (its command included) and the benchmarks are one
    client each, the CLI's entry points one, and every other command its own."""
    for whole in ("conclave.tuning", "bench"):
        if within(name, (whole,)):
            return whole
    return "conclave.cluster.cli" if within(name, ("conclave.__main__",)) else name


def test_no_import_cycle():
    index, low, on_stack, stack, cycles, counter = {}, {}, set(), [], [], [0]

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in sorted(GRAPH[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in sorted(GRAPH):
        if name not in index:
            visit(name)
    assert not cycles, f"import cycles: {cycles}"


def test_each_layer_imports_only_the_layers_below():
    wrong = []
    for name, targets in GRAPH.items():
        own = layer(name)
        if own is None:
            continue
        allowed = LAYERS[: LAYERS.index(own) + 1]
        wrong += [(name, t) for t in targets if layer(t) is not None and layer(t) not in allowed]
    assert not wrong, wrong


def test_the_library_never_imports_its_clients():
    wrong = [(name, t) for name, targets in GRAPH.items()
             if name.startswith("conclave.cluster") and not is_client(name)
             for t in targets if is_client(t)]
    assert not wrong, wrong


def test_no_client_imports_another():
    """e.g. tuning never imports ``run_command``, nor ``serve_command`` the run's: what both
    need (the config loader, the exit codes, one line per failure) is the library's."""
    wrong = [(name, t) for name, targets in GRAPH.items() if is_client(name)
             for t in targets if is_client(t) and client_of(t) != client_of(name)]
    assert not wrong, wrong


def test_tuning_and_the_benchmarks_import_only_the_library():
    """Of the project, tuning and the benchmarks import the library's modules only (and their own):
    no client, and a pipeline only as a whole (``cluster.api``, ``cluster.pipelines``)."""
    wrong = [(name, t) for name, targets in GRAPH.items() if client_of(name) in ("conclave.tuning", "bench")
             for t in targets
             if (is_client(t) and client_of(t) != client_of(name)) or t.startswith("conclave.cluster.pipelines.")]
    assert not wrong, wrong


def test_clients_reach_pipelines_only_as_a_whole():
    """The CLI, tuning and the benchmarks load a pipeline (``cluster.pipelines.load_pipeline``) or
    name one (``cluster.api``) and call its methods: never one pipeline module's insides."""
    wrong = [(name, t) for name, targets in GRAPH.items() if is_client(name)
             for t in targets if t.startswith("conclave.cluster.pipelines.")]
    assert not wrong, wrong


# The front door of the library for tuning and the benchmarks: the API and the pipelines, the
# config loader (``load_yaml``, ``from_dict``, ``ConfigError``) and how a run is recorded (MLflow).
FRONT_DOOR = ("conclave.cluster.api", "conclave.cluster.pipelines", "conclave.cluster.config",
              "conclave.cluster.tracking")
# Benchmarks that time or replay one component below the pipelines, and what each may reach for it.
# The list may only shrink: an entry no longer used fails the test.
COMPONENT_BENCHMARKS = {
    "bench.perf": ({"conclave.actors.aggregator", "conclave.actors.teacher"},
                   "times the aggregator server on fixed votes and the teacher actors' voting"),
    "bench.service_soak": ({"conclave.actors.aggregator", "conclave.actors.labeller", "conclave.actors.teacher",
                            "conclave.cluster.ray_runtime"},
                           "checks a running `conclave serve` against the service's own constants and reclaims its Ray"),
    "bench.gateway_overhead": ({"conclave.cluster.gateway.client", "conclave.cluster.gateway.identity",
                                "conclave.cluster.gateway.local", "conclave.cluster.owners"},
                               "times the gateways' vote source, in the run's process and in processes of their "
                               "own, below the pipeline"),
    "bench.proposal_proxy": ({"conclave.cluster.proposal", "conclave.actors.vote_parties"},
                             "replays the proposal's own rules on public data"),
    "bench.student_proxy": ({"conclave.actors.student"}, "times the student's training path alone"),
    "bench.teacher_student_mnist": ({"conclave.actors.aggregator", "conclave.actors.teacher",
                                     "conclave.cluster.teaching.ensemble", "conclave.cluster.teaching.student"},
                                    "measures trained teachers' clean votes and serving time beside the pipeline's runs"),
}


def test_tuning_and_the_benchmarks_use_the_front_door():
    """Of actors/ and cluster/, tuning and the benchmarks import only the front door
    (``FRONT_DOOR``): what they need that a pipeline computes is a method of the pipeline (e.g.
    ``SparseFinetune.trial``) or a name ``cluster.api`` exports, so no owner's ledger or policy
    is skipped by reaching past it. The layers below (privacy; learning's data loading, models
    and embeddings on public data) they use directly. The one exception: a benchmark of one
    component (``COMPONENT_BENCHMARKS``), for that component only."""
    reached = {(name, t) for name, targets in GRAPH.items() if client_of(name) in ("conclave.tuning", "bench")
               for t in targets if within(t, ("conclave.actors", "conclave.cluster")) and t not in FRONT_DOOR}
    allowed = {(name, t) for name, (targets, _) in COMPONENT_BENCHMARKS.items() for t in targets}
    assert not reached - allowed, sorted(reached - allowed)
    assert not allowed - reached, f"no longer reached (drop from COMPONENT_BENCHMARKS): {sorted(allowed - reached)}"
