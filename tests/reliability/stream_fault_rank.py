"""One rank of a two-process BalancedStream world with a fault, run as a plain process (`python
stream_fault_rank.py CONFIG_JSON`, rank and rendezvous from the environment as torchrun sets them; no elastic agent,
which would kill the survivors itself). The faulty rank dies (SIGKILL), stalls (sleeps until the test kills it) or
stops reading and closes once the others closed; the other ranks (all of them without a faulty one) read on and
write what they yielded, the error that stopped them and what `close()` logged to `<out>/rank<r>.json`."""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "streaming"))
from stream_cases import doc_rows  # noqa: E402

import balancer  # noqa: E402
from balancer.streaming import BalancedStream  # noqa: E402

TOPO = balancer.Topology(dp=2, micro_batches=2, max_tokens=512)
COST = balancer.CostModel(1.0, 50.0)
DOCS, WINDOW = 160, 24


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _wait_for(path: Path, limit: float = 120.0) -> None:
    end = time.monotonic() + limit
    while not path.exists() and time.monotonic() < end:
        time.sleep(0.05)


def _faulty(stream: BalancedStream, cfg: dict, out: Path) -> None:
    """The faulty rank: read `at` micro-batches, then fail as `fault` says."""
    it = iter(stream) if cfg["at"] > 0 else None
    for _ in range(cfg["at"]):
        next(it)
    if cfg["fault"] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if cfg["fault"] == "stall":
        time.sleep(600)  # the test kills it once the others are done
    if cfg["fault"] == "stop":  # stops reading before the next window's job; closes once the others closed
        _wait_for(out / "closed")
        stream.close()


def _survivor(stream: BalancedStream, cfg: dict, out: Path, rank: int) -> None:
    lines = _Lines()
    logging.getLogger("balancer.streaming.teardown").addHandler(lines)
    got, windows, error, started = [], [], None, time.monotonic()
    it = iter(stream)
    try:
        while cfg.get("read") is None or len(got) < cfg["read"]:
            try:
                got.append([r["doc"] for r in next(it)])
            except StopIteration:
                break
            windows.append(stream.stats()["windows"])  # the window of this micro-batch (windows finished before)
    except Exception as e:  # the error every survivor must get
        error = f"{type(e).__name__}: {e}"
    waited = time.monotonic() - started
    t0 = time.monotonic()
    stream.close(cfg.get("close_wait"))
    closing = time.monotonic() - t0
    after = None
    try:
        next(it)
    except Exception as e:
        after = type(e).__name__
    result = {"batches": got, "windows": windows, "error": error, "warnings": lines.lines, "after_close": after}
    result.update(seconds=waited, close_seconds=closing)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    (out / "closed").touch()
    while len(list(out.glob("rank*.json"))) < 2 - (cfg.get("faulty") is not None):  # no exit under a peer's collective
        time.sleep(0.05)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    rank = int(os.environ["RANK"])
    out = Path(cfg["out"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    stream = BalancedStream(
        doc_rows(DOCS, 0), TOPO, COST, window_docs=WINDOW, timeout=cfg["timeout"], close_timeout=cfg["close_timeout"]
    )
    if rank == cfg.get("faulty"):
        _faulty(stream, cfg, out)
    else:
        _survivor(stream, cfg, out, rank)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter finalization under a peer's dead sockets (support.dist.leave_without_finalization)


if __name__ == "__main__":
    main()
