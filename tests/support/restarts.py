"""Kill-and-relaunch runs of the restart examples under torchrun, for the restart tests: a first launch on N
processes that a killed worker stops, a relaunch on M from the last checkpoint, and what every rank traced (one
JSON line per step, each naming its `world`); the tokens the traced steps trained, per document. For torchrun's
own elastic restarts: an elastic agent as one "node" on the loopback (`elastic_agent`), and a node's loss (`kill_tree`:
the agent and its workers, SIGKILL)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
# the elastic tests' rendezvous: heartbeats every second, a node dead after 5 missed; a round completes 8 s after its
# first node joins unless both are in (max nodes reached: at once): the second agent's store client retries its
# connection every ~2 s until the host's store is up, so both join the first round; generous join timeout for a
# loaded machine (docs/fault-tolerance.md says what each does)
ELASTIC_RDZV = {"join_timeout": 180, "last_call_timeout": 8, "keep_alive_interval": 1, "keep_alive_max_attempt": 5}


def launch(script: str, nproc: int, *args: str, timeout: float = 420) -> tuple[int, str]:
    """Run `examples/<script>` under torchrun (standalone, no elastic restart) on `nproc` processes over gloo on
    the loopback: (exit code, the end of its output)."""
    torchrun = str(Path(sys.executable).parent / "torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "0",
           str(ROOT / "examples" / script), *args]  # fmt: skip
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    return out.returncode, (out.stdout + out.stderr)[-4000:]


def read_trace(folder: Path) -> list[dict]:
    """Every JSON line of every `*.jsonl` file in `folder` (files in name order)."""
    return [json.loads(x) for f in sorted(folder.glob("*.jsonl")) for x in f.read_text().splitlines() if x.strip()]


def kill_then_relaunch(
    script: str,
    trace: Path,
    first: tuple[int, list[str]],
    second: tuple[int, list[str]],
    between: Callable[[str], None] = lambda tail: None,
) -> tuple[list[dict], list[dict]]:
    """Launch `script` on `first[0]` processes with arguments `first[1]` (the job must stop: a worker killed), call
    `between(output tail)`, launch it again on `second[0]` with `second[1]` (it must finish); the traced lines of
    each launch, told apart by their `world` (every traced line belongs to one of the two)."""
    code, tail = launch(script, first[0], *first[1])
    assert code != 0, f"the first launch did not stop: {tail}"
    between(tail)
    code, tail = launch(script, second[0], *second[1])
    assert code == 0, tail
    lines = read_trace(trace)
    before = [r for r in lines if r["world"] == first[0]]
    after = [r for r in lines if r["world"] == second[0]]
    assert before and after and len(before) + len(after) == len(lines), (len(before), len(after), len(lines))
    return before, after


def token_coverage(pieces: Iterable, lengths: np.ndarray) -> np.ndarray:
    """How many times each token of the corpus (documents concatenated) is in `pieces`: each piece a `Span`, a
    document index, or its JSON form `[doc]` / `[doc, start, end]`."""
    offset = np.concatenate([[0], np.cumsum(lengths)])
    seen = np.zeros(int(offset[-1]), dtype=np.int64)
    for p in pieces:
        if hasattr(p, "doc"):
            d, a, b = p.doc, p.start, p.end
        elif isinstance(p, (list, tuple)):
            d, a, b = (p[0], 0, int(lengths[p[0]])) if len(p) == 1 else p
        else:
            d, a, b = int(p), 0, int(lengths[int(p)])
        seen[offset[d] + a : offset[d] + b] += 1
    return seen


def free_port() -> int:
    """A TCP port free on the loopback now (for a rendezvous endpoint)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def elastic_agent(script: str, args: list[str], log: Path, rdzv: dict, nnodes: str = "1:2",
                  max_restarts: int = 1, nproc: int = 1) -> subprocess.Popen:  # fmt: skip
    """One torchrun elastic agent (one "node", `nproc` workers) running `examples/<script> args` in the c10d rendezvous
    `rdzv` (`endpoint`, `id`, then the `--rdzv-conf` settings: `is_host`, timeouts, ...) on the loopback. Its log
    (the agent's at INFO level: each rendezvous' result and restart count; and its worker's) goes to `log`."""
    conf = ",".join(f"{k}={v}" for k, v in rdzv.items() if k not in ("endpoint", "id"))
    cmd = [str(Path(sys.executable).parent / "torchrun"), f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv['endpoint']}", f"--rdzv-id={rdzv['id']}",
           f"--rdzv-conf={conf}", "--local-addr=127.0.0.1", f"--max-restarts={max_restarts}",
           "--monitor-interval=0.5", str(ROOT / "examples" / script), *args]  # fmt: skip
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env={**env, "LOGLEVEL": "INFO"}, stdout=out, stderr=subprocess.STDOUT)


def process_tree(pid: int) -> list[int]:
    """`pid` and its living descendants (from /proc): torchrun starts each worker in a session of its own, so a
    node's processes are its agent's tree, not its process group."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):  # gone meanwhile
                continue
            children.setdefault(parent, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def lose_node(
    script: str, args: list[str], hold: int, tmp_path: Path, trace: Path, nproc: int = 1
) -> tuple[str, list[int]]:
    """Two elastic agents on the loopback (`elastic_agent`, ELASTIC_RDZV, the surviving one hosting the store) run
    `examples/<script> args`; the other node's `nproc` workers stop at the end of step `hold` (`--hold-at`), then that
    node, its agent and its workers, is SIGKILLed; the survivor must end with exit code 0. (the surviving agent's
    log, the held ranks)."""
    rdzv = {"endpoint": f"127.0.0.1:{free_port()}", "id": f"elastic-{uuid.uuid4().hex[:8]}", **ELASTIC_RDZV}
    logs = {name: tmp_path / f"{name}.log" for name in ("lost", "host")}
    # the lost node first: its agent waits for the host's store, so both join the first round together
    lost = elastic_agent(script, [*args, "--hold-at", str(hold)], logs["lost"], {**rdzv, "is_host": 0}, nproc=nproc)
    host = elastic_agent(script, args, logs["host"], {**rdzv, "is_host": 1}, nproc=nproc)
    try:
        held = _wait_held(trace, {"lost": (lost, logs["lost"]), "host": (host, logs["host"])}, nproc, hold)
        kill_tree(lost.pid)  # the node is lost: its agent and its workers, SIGKILL
        code = host.wait(timeout=400)
    finally:
        for proc in (lost, host):
            if proc.poll() is None:
                kill_tree(proc.pid)
            proc.wait()
    log = logs["host"].read_text()
    assert code == 0, log[-4000:]
    return log, held


def _wait_held(trace: Path, agents: dict, count: int, hold: int, timeout: float = 300) -> list[int]:
    """The ranks whose `held-rank<R>` files the lost node's `count` workers write at the end of step `hold`; fails
    early if an agent ends."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        held = sorted(int(f.name.removeprefix("held-rank")) for f in trace.glob("held-rank*"))
        if len(held) == count:
            return held
        for name, (proc, log) in agents.items():
            assert proc.poll() is None, f"the {name} agent ended ({proc.returncode}) early: {log.read_text()[-4000:]}"
        time.sleep(0.2)
    raise AssertionError(f"the lost node's {count} workers did not all reach the end of step {hold} in {timeout} s")


def kill_tree(pid: int) -> list[int]:
    """SIGKILL `pid` and its descendants at once (a node lost); the pids killed."""
    tree = process_tree(pid)
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return tree


def traced_tokens(lines: Iterable[dict]) -> Counter:
    """Tokens trained per document over traced steps of examples/trainer_restart.py (each line's `tokens`)."""
    seen: Counter = Counter()
    for r in lines:
        seen.update({int(d): n for d, n in r["tokens"].items()})
    return seen
