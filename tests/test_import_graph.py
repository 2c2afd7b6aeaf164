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


def lazy_exports(tree: ast.Module) -> set[str]:
    """The modules a module's ``EXPORTS`` table (module → names, imported on first use: ``cluster.api``) names."""
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "EXPORTS":
            return set(ast.literal_eval(node.value))
    return set()


def imports_of(name: str) -> set[str]:
    """The project modules ``name`` imports (``from pkg import sub`` counts ``pkg.sub`` when it is a
    module), its lazy exports included."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    found = {t for t in lazy_exports(tree) if t in MODULES}
    for node in ast.walk(tree):
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


# The front door of the library for tuning and the benchmarks: the API (which exports the config
# loader, tracking and the components a benchmark times alone) and the pipelines.
FRONT_DOOR = ("conclave.cluster.api", "conclave.cluster.pipelines")


def test_tuning_and_the_benchmarks_use_the_front_door():
    """Of actors/ and cluster/, tuning and the benchmarks import only the front door
    (``FRONT_DOOR``): what they need that a pipeline computes is a method of the pipeline (e.g.
    ``SparseFinetune.trial``) or a name ``cluster.api`` exports, so no owner's ledger or policy
    is skipped by reaching past it. The layers below (privacy; learning's data loading, models
    and training on public data) they use directly."""
    reached = sorted((name, t) for name, targets in GRAPH.items() if client_of(name) in ("conclave.tuning", "bench")
                     for t in targets if within(t, ("conclave.actors", "conclave.cluster")) and t not in FRONT_DOOR)
    assert not reached, reached
