"""Every command README.md and docs/ show is one that runs as written.

Each `conclave …` line of a shell block is parsed by the CLI's own parser (an option it does not
take fails here, not on a user's screen), the configs and scripts it names exist and load, `make`
targets exist, and the commands that are cheap and need no cluster or data outside the repo run.
Placeholders the text asks the reader to fill in (HEAD_IP, VOTES.npy, …) are taken as given.
"""
from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conclave.cluster.cli import COMMANDS, build_parser
from conclave.cluster.config import load_yaml
from conclave.cluster.pipelines import load_pipeline
from tests.ray_heads import running_head

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_FENCES = ("```bash", "```sh", "```shell", "```console")
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")
VENV_BIN = ".venv/bin/"


def shell_lines(page: Path) -> list[str]:
    """Commands of the page's shell blocks: continuations joined, comments dropped."""
    lines, inside, pending = [], False, ""
    for raw in page.read_text().splitlines():
        stripped = raw.strip()
        if stripped.startswith("```"):
            inside = stripped in SHELL_FENCES
            continue
        if not inside or not stripped:
            continue
        line = pending + stripped
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        lines.append(line)
    return lines


def words(line: str) -> list[str]:
    """The command's words, without leading VAR=value assignments, `.venv/bin/` or a trailing comment."""
    parts = shlex.split(line, comments=True)
    while parts and ENV_ASSIGNMENT.match(parts[0]):
        parts = parts[1:]
    if parts and parts[0].startswith(VENV_BIN):
        parts[0] = parts[0][len(VENV_BIN):]
    return parts


def conclave_commands() -> list[tuple[str, list[str]]]:
    found = []
    for page in PAGES:
        for line in shell_lines(page):
            parts = words(line)
            if "--" in parts:  # `ray job submit … -- conclave run …`: the job's entrypoint
                parts = parts[parts.index("--") + 1:]
            if parts and parts[0] == "conclave" and not any("{" in p for p in parts):  # not a usage synopsis
                found.append((f"{page.name}: {line}", parts[1:]))
    return found


COMMANDS_SHOWN = conclave_commands()


def test_the_docs_show_commands():
    assert len(COMMANDS_SHOWN) > 20
    shown = {argv[0] for _, argv in COMMANDS_SHOWN if argv and not argv[0].startswith("-")}
    assert {"run", "serve", "query", "analyze", "check-data", "ray-certs", "tune"} <= shown


@pytest.mark.parametrize("where,argv", COMMANDS_SHOWN, ids=[w[:90] for w, _ in COMMANDS_SHOWN])
def test_each_conclave_command_parses_and_names_real_files(where, argv):
    assert argv and argv[0] in COMMANDS or argv[0].startswith("-"), where
    parser = build_parser(argv[0])
    try:
        parser.parse_args(argv)
    except SystemExit as exit_:
        assert exit_.code == 0, f"{where}: the CLI does not take these arguments"
    for word in argv:
        if word.startswith("configs/"):
            raw = load_yaml(ROOT / word)
            load_pipeline(raw["base"] if argv[0] == "tune" else raw)  # a sweep's base is a run config


def test_every_script_and_make_target_named_exists():
    makefile = (ROOT / "Makefile").read_text()
    for page in PAGES:
        for line in shell_lines(page):
            parts = words(line)
            if len(parts) > 1 and parts[0] in ("python", "python3"):
                assert (ROOT / parts[1]).is_file(), f"{page.name}: {line}"
            if len(parts) > 1 and parts[0] == "make":
                assert re.search(rf"^{re.escape(parts[1])}:", makefile, re.M), f"{page.name}: {line}"


@pytest.mark.parametrize("argv", [
    ["--version"],
    ["check-data", "configs/hospitals.yaml", "--owner", "hospital_a"],
])
def test_cheap_commands_run_as_written(argv):
    result = subprocess.run([sys.executable, "-m", "conclave", *argv], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    shown = {tuple(a) for _, a in COMMANDS_SHOWN}
    assert argv == ["--version"] or tuple(argv) in shown


def head_command() -> str:
    """docs/cluster-and-tuning.md's local head: the one `ray start --head` line that names its ports."""
    [line] = [line for line in shell_lines(ROOT / "docs" / "cluster-and-tuning.md")
              if "ray start --head" in line and "--temp-dir=" in line]
    return line


def test_the_documented_head_keeps_its_fixed_ports_outside_rays_worker_range():
    ports = {option: int(value) for option, value in re.findall(r"(--[a-z-]*port)=(\d+)", head_command())}
    low, high = ports.pop("--min-worker-port", 10002), ports.pop("--max-worker-port", 19999)  # Ray's defaults
    assert ports and not [option for option, port in ports.items() if low <= port <= high]


def test_the_documented_head_starts_as_written(tmp_path):
    # As written, with --block: the head then runs in this test's process group, and stopping that
    # group stops only what it started (`ray stop` would stop every Ray on the machine).
    line = head_command()
    ports = [int(port) for port in re.findall(r"--[a-z-]*port=(\d+)", line)]
    temp_dir = Path(re.search(r"--temp-dir=(\S+)", line).group(1))
    for port in ports:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                pytest.fail(f"port {port} is taken: stop the docs' head (`ray stop`) and run again")
    if temp_dir.exists():
        pytest.fail(f"{temp_dir} exists: stop the docs' head and remove it, then run again")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")  # the venv, as the docs say
    log = tmp_path / "head.log"
    with running_head(["bash", "-c", f"{line} --block"], env, log, temp_dir, cwd=ROOT):
        with socket.create_connection(("127.0.0.1", ports[0]), timeout=10):  # the GCS answers on its port
            pass
