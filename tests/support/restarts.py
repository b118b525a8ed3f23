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
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


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
