"""A torchft run on CPU, for benchmarks/faults.py and tests/integrations/test_torchft*: torchft's lighthouse
(`torchft_lighthouse`) and every replica group as real processes on gloo, replicas killed with SIGKILL at chosen
steps and phases and started again (they rejoin and heal from their peers), one JSON line per step and group.

    python benchmarks/faults_run.py --worker CONFIG.json GROUP LIFE RANK    (what `run` starts; not for users)

The model is a tiny causal-attention LM in float64 (per-document attention: a step's compute grows with the square
of its documents' lengths, as the cost model says), trained with SGD so that a single-process replay of the
committed steps (`replay`) must give the same weights. `loader="balanced"` is `FaultTolerantBatches`;
`loader="torchft"` is torchft's own `DistributedSampler` (a fixed batch of documents per group and step), for the
benchmark's comparison.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("forward", "reduce", "between")


@dataclasses.dataclass
class Config:
    out: str
    groups: int = 3
    docs: int = 240
    seed: int = 0
    max_len: int = 96
    micro_batches: int = 2
    max_tokens: int = 128
    tokens_per_step: int = 0  # 0: half of dp * micro_batches * max_tokens
    window_docs: int = 0  # 0: the whole epoch
    async_quorum: bool = True
    loader: str = "balanced"
    kills: list = dataclasses.field(default_factory=list)  # [group, committed step, phase]
    rejoin_seconds: float = 1.0
    cp: int = 1  # processes per replica group
    train: bool = True  # False: the data path only (CP runs)
    mode: str = "shadow"
    monitor: str = ""  # "shadow" / "adapt": a BalanceMonitor attached to every process's FaultTolerantBatches
    slow: dict = dataclasses.field(default_factory=dict)  # group -> [from committed step, extra seconds per token^2]
    batch_docs: int = 8  # torchft loader: documents per group and step
    max_steps: int = 0  # torchft loader: committed steps to run
    work: float = 0.0  # device seconds (slept) per 1e6 cost-model units of a micro-batch
    dim: int = 8
    lr: float = 0.05
    timeout_s: float = 300.0
    comm_timeout_s: float = 3.0  # torchft's Manager and gloo timeouts: how long a reduction waits for a dead peer
    min_replicas: int = 0  # lighthouse and Manager minimum; 0: a majority of `groups` (below one: split brain)
    heartbeat_timeout_ms: int = 1500  # the lighthouse: a replica silent this long is dead (left out of quorums)
    join_timeout_ms: int = 1000  # the lighthouse: how long a quorum waits for heartbeating stragglers to join
    heartbeat_interval_ms: int = 100  # the Manager: how often a replica heartbeats to the lighthouse
    abort_failed: bool = True  # abort the process group after a step that did not commit (the next quorum rebuilds it)

    @property
    def quorum_minimum(self) -> int:
        return self.min_replicas or self.groups // 2 + 1

    def lengths(self) -> np.ndarray:
        rng = np.random.default_rng(self.seed)
        return np.minimum(rng.lognormal(math.log(self.max_len / 4), 0.9, self.docs).astype(np.int64) + 2, self.max_len)

    def topology(self):
        import balancer

        tps = self.tokens_per_step or self.groups * self.micro_batches * self.max_tokens // 2
        return balancer.Topology(
            dp=self.groups,
            cp=self.cp,
            micro_batches=self.micro_batches,
            max_tokens=self.max_tokens,
            tokens_per_step=tps,
        )


def cost_model():
    import balancer

    return balancer.CostModel(attn_coef=1.0, linear_coef=64.0)


def tokens_of(doc: int, length: int, vocab: int = 31):
    import torch

    return (torch.arange(length, dtype=torch.int64) * 7 + doc * 13) % vocab


# ---- the model -----------------------------------------------------------------------------------------------------
def make_model(dim: int):
    import torch

    torch.manual_seed(1234)
    model = torch.nn.ModuleDict(
        {"emb": torch.nn.Embedding(31, dim), "q": torch.nn.Linear(dim, dim), "out": torch.nn.Linear(dim, 31)}
    ).double()
    return model


def doc_logits(model, ids):
    import torch

    x = model["emb"](ids)
    s = model["q"](x) @ x.T / math.sqrt(x.shape[-1])
    s = s.masked_fill(torch.triu(torch.ones_like(s, dtype=torch.bool), 1), float("-inf"))
    return model["out"](torch.softmax(s, -1) @ x + x)


def packed_loss_sum(model, batch):
    """Sum of token cross-entropies of a packed micro-batch (PackedCollator output, cp 1), per-document attention."""
    import torch

    cu = batch["cu_seqlens"].tolist()
    ids, labels = batch["input_ids"][0], batch["labels"][0]
    logits = torch.cat([doc_logits(model, ids[a:b]) for a, b in zip(cu[:-1], cu[1:]) if b > a])
    return torch.nn.functional.cross_entropy(logits, labels[: len(logits)], ignore_index=-100, reduction="sum")


# ---- the worker ----------------------------------------------------------------------------------------------------
class TokenDocs:
    def __init__(self, lengths) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, d: int) -> dict:
        return {"input_ids": tokens_of(int(d), int(self.lengths[int(d)]))}


def piece_json(x) -> list:
    from balancer.training.indices import Span

    return [x.doc, x.start, x.end] if isinstance(x, Span) else [int(x)]


def state_digest(state: dict) -> str:
    keep = {k: v for k, v in state.items() if k not in ("speeds", "monitor", "fit")}  # each group's own measurements
    keep["members"] = state["speeds"]["members"]
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


def make_manager(cfg: Config, group: int, rank: int, model, opt):
    """torchft's Manager of this process and its process group (the lighthouse and the group's store from the
    driver's environment)."""
    from torchft import Manager, ProcessGroupGloo

    pg = ProcessGroupGloo(timeout=timedelta(seconds=cfg.comm_timeout_s))
    return pg, Manager(
        pg=pg,
        min_replica_size=cfg.quorum_minimum,
        load_state_dict=lambda s: (model.load_state_dict(s["model"]), opt.load_state_dict(s["opt"])),
        state_dict=lambda: {"model": model.state_dict(), "opt": opt.state_dict()},
        replica_id=f"g{group}",
        store_addr="localhost",
        store_port=int(os.environ["FAULTS_STORE_PORT"]),
        rank=rank,
        world_size=cfg.cp,
        lighthouse_addr=os.environ["TORCHFT_LIGHTHOUSE"],
        use_async_quorum=cfg.async_quorum,
        timeout=timedelta(seconds=cfg.comm_timeout_s),
        quorum_timeout=timedelta(seconds=60),
        connect_timeout=timedelta(seconds=30),
        heartbeat_interval=timedelta(milliseconds=cfg.heartbeat_interval_ms),
    )


def worker(cfg: Config, group: int, life: int, rank: int) -> None:
    """One process of one replica group: steps until the epoch is done, one JSON line per step, a final line."""
    import torch

    import balancer
    from balancer.integrations.torchft import FaultTolerantBatches

    torch.set_num_threads(1)
    lengths = cfg.lengths()
    model = make_model(cfg.dim)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    batches = FaultTolerantBatches(lengths, cfg.topology(), cost_model(), replica_id=f"g{group}", seed=cfg.seed,
                                   window_docs=cfg.window_docs or None, mode=cfg.mode)  # fmt: skip
    monitor = balancer.BalanceMonitor(batches, mode=cfg.monitor, cuda=False, warmup_steps=1) if cfg.monitor else None
    pg, manager = make_manager(cfg, group, rank, model, opt)
    manager.register_state_dict_fn("batches", batches.load_state_dict, batches.state_dict)
    if life == 0:
        barrier(Path(cfg.out), f"g{group}_r{rank}", cfg.groups * cfg.cp)
    loop = _Loop(cfg, lengths, model, opt, batches, manager, balancer.PackedCollator(cp_rank=rank, cp_size=cfg.cp))
    loop.pg = pg
    loop.kill = [tuple(k[1:]) for k in cfg.kills if k[0] == group and life == 0 and rank == 0]
    loop.slow = cfg.slow.get(str(group))
    with open(Path(cfg.out) / f"g{group}_r{rank}_life{life}.jsonl", "a", buffering=1) as log:
        while (record := loop.step()) is not None:
            log.write(json.dumps({"group": group, "rank": rank, "life": life, **record}) + "\n")
            if (batches.committed_steps, "between") in loop.kill:
                os.kill(os.getpid(), signal.SIGKILL)
        final = {"state": state_digest(batches.state_dict()), "report": batches.report(), "log": batches.log[-200:]}
        if monitor is not None:
            final["monitor"] = {"steps": [s["step"] for s in monitor.ledger.steps], "fits": len(batches.fits),
                                "refits": [r["reason"] for r in monitor.refits]}  # fmt: skip
        log.write(json.dumps({"group": group, "rank": rank, "life": life, "final": True, **final}) + "\n")
    if rank == 0:
        torch.save(model.state_dict(), Path(cfg.out) / f"final_g{group}.pt")
    manager.shutdown(wait=False)


class _Loop:
    """The training step of a replica process (the loop of docs/fault-tolerance.md), with the kills it was given."""

    def __init__(self, cfg: Config, lengths, model, opt, batches, manager, collate) -> None:
        import balancer

        self.cfg, self.lengths, self.model, self.opt = cfg, lengths, model, opt
        self.batches, self.manager, self.collate = batches, manager, collate
        self.data = balancer.SpanDataset(TokenDocs(lengths))
        self.kill, self.slow, self.pg = [], None, None

    def step(self):
        """One step; its record, or None when the epoch is done."""
        b, manager = self.batches, self.manager
        manager.start_quorum()
        t0 = time.perf_counter()
        items = b.next_step(manager)
        if items is None:
            return None
        done = b.committed_steps
        record = {"committed_before": done, "t0": time.time(), "loss_tokens": b.loss_tokens(),
                  "mine": [[piece_json(x) for x in mb] for mb in items]}  # fmt: skip
        record.update(self.micro_batches(items, done))
        reduce_gradients(manager, self.model, (done, "reduce") in self.kill)
        committed = manager.should_commit()
        if committed:
            self.opt.step()
        elif self.cfg.abort_failed and self.pg is not None:
            self.pg.abort()  # peers blocked on this group in the ring see it now, not after their timeout
        self.opt.zero_grad(set_to_none=False)
        plan = b.step_plan()
        b.end_step(committed)
        pieces = None if plan is None else [plan[0], [[[piece_json(x) for x in mb] for mb in m] for m in plan[1]]]
        record.update(committed=committed, seconds=time.perf_counter() - t0, t1=time.time(),
                      state=state_digest(b.state_dict()), committed_after=b.committed_steps,
                      manager_step=manager.current_step(), plan=pieces,
                      imbalance=b.log[-1]["imbalance"] if (b.log and plan) else None)  # fmt: skip
        return record

    def micro_batches(self, items: list, done: int) -> dict:
        """Forward + backward of this process's micro-batches (loss over the step's global loss tokens)."""
        loss_sum, my_loss_tokens, compute = 0.0, 0, 0.0
        for mb in items:
            batch = self.collate([self.data[x] for x in mb])
            my_loss_tokens += int(batch["num_loss_tokens"])
            if (done, "forward") in self.kill:
                os.kill(os.getpid(), signal.SIGKILL)
            c0 = time.perf_counter()
            with self.batches.timer():
                if self.cfg.train:
                    loss = packed_loss_sum(self.model, batch)
                    (loss / self.batches.loss_tokens()).backward()
                    loss_sum += float(loss)
                device_time(self.cfg, self.lengths, mb, self.slow, done)
            compute += time.perf_counter() - c0
        return {"loss_sum": loss_sum, "my_loss_tokens": my_loss_tokens, "compute": compute}


def barrier(out: Path, name: str, count: int) -> None:
    """Every first-life process has its Manager before the first quorum (so the first quorum holds every group)."""
    (out / f"ready_{name}").touch()
    end = time.time() + 120
    while len(list(out.glob("ready_*"))) < count and time.time() < end:
        time.sleep(0.05)


def device_time(cfg: Config, lengths, mb, slow, done: int) -> None:
    """A device's share of the step: `work` seconds per 1e6 cost-model units of the micro-batch, slept (the host's
    cores stay free, as they do while an accelerator computes; 2 cores cannot run 4 replicas' compute for real);
    `slow` = [from committed step, extra factor] makes a group slower from a step on."""
    from balancer.training.indices import Span

    sizes = np.array([(x.end - x.start) if isinstance(x, Span) else int(lengths[int(x)]) for x in mb])
    factor = 1.0 + (slow[1] if slow and done >= slow[0] else 0.0)
    time.sleep(cfg.work * float(cost_model().cost(sizes).sum()) / 1e6 * factor)


def reduce_gradients(manager, model, die: bool) -> None:
    """Sum every gradient over the contributing groups (each is already normalised by the step's global loss tokens)."""
    import torch
    from torch.distributed import ReduceOp

    works = []
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        works.append(manager.allreduce(p.grad, reduce_op=ReduceOp.SUM))
        if die:
            os.kill(os.getpid(), signal.SIGKILL)
    for w in works:
        w.wait()


# ---- the driver ----------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def lighthouse(min_replicas: int = 1, heartbeat_ms: int = 1500, join_ms: int = 1000) -> tuple[subprocess.Popen, str]:
    """torchft's lighthouse as a process; (process, its address)."""
    port = free_port()
    exe = str(Path(sys.executable).parent / "torchft_lighthouse")
    proc = subprocess.Popen(
        [
            exe,
            "--min_replicas",
            str(min_replicas),
            "--bind",
            f"[::]:{port}",
            "--join_timeout_ms",
            str(join_ms),
            "--heartbeat_timeout_ms",
            str(heartbeat_ms),
            "--quorum_tick_ms",
            "20",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return proc, f"http://localhost:{port}"


def run(cfg: Config) -> dict:
    """Run the configuration: every group (and its CP ranks) as processes, each kill of `cfg.kills` carried out by
    the replica itself (SIGKILL at the phase of the step), a killed group started again `rejoin_seconds` later
    unless a group has already finished the run. Returns {"lines", "finals", "wall", "lives"}."""
    import torch.distributed as dist

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    lh, address = lighthouse(cfg.quorum_minimum, cfg.heartbeat_timeout_ms, cfg.join_timeout_ms)
    stores = [dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False) for _ in range(cfg.groups)]
    lives, procs, pending, finished = {}, {}, {}, set()
    t0 = time.time()

    def start(g: int, life: int) -> None:
        env = {
            **os.environ,
            "TORCHFT_LIGHTHOUSE": address,
            "FAULTS_STORE_PORT": str(stores[g].port),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT),
        }
        for r in range(cfg.cp):
            err = open(out / f"g{g}_r{r}_life{life}.err", "w")
            procs[(g, r)] = subprocess.Popen(
                [sys.executable, __file__, "--worker", str(out / "config.json"), str(g), str(life), str(r)],
                env=env,
                stderr=err,
                stdout=err,
            )
        lives[g] = life

    try:
        for g in range(cfg.groups):
            start(g, 0)
        while True:
            if time.time() - t0 > cfg.timeout_s:
                raise TimeoutError(f"the run did not finish in {cfg.timeout_s} s: {_tails(out)}")
            _poll(cfg, procs, lives, pending, finished, out)
            for g, when in list(pending.items()):
                if time.time() >= when:
                    del pending[g]
                    if not finished:
                        start(g, lives[g] + 1)
            if finished:  # the epoch is done: a group still joining (or waiting to) is stopped
                end = time.time() + 3.0
                while time.time() < end and any(p.poll() is None for p in procs.values()):
                    time.sleep(0.05)
                break
            time.sleep(0.05)
        wall = time.time() - t0
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        lh.kill()
        lh.wait()
    return {**read_logs(out), "wall": wall, "lives": dict(lives), "finished": sorted(finished)}


def _killed(procs, g: int, cfg: Config) -> bool:
    return all(procs[(g, r)].poll() is not None and procs[(g, r)].returncode != 0 for r in range(cfg.cp))


def _poll(cfg: Config, procs, lives, pending, finished, out: Path) -> None:
    for g in range(cfg.groups):
        codes = [procs[(g, r)].poll() for r in range(cfg.cp)]
        if g in finished or g in pending or any(c is None for c in codes) and not any(c == -9 for c in codes):
            continue
        if all(c == 0 for c in codes):
            finished.add(g)
        elif any(c == -9 for c in codes):
            for r in range(cfg.cp):  # a group is killed whole: its other ranks go with it
                if procs[(g, r)].poll() is None:
                    procs[(g, r)].kill()
                    procs[(g, r)].wait()
            pending[g] = time.time() + cfg.rejoin_seconds
        elif not finished:
            raise RuntimeError(f"replica group {g} failed with exit codes {codes}: {_tails(out)}")


def _tails(out: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(out.glob("*.err")) if p.stat().st_size)


def read_logs(out: Path) -> dict:
    lines, finals = [], []
    for p in sorted(out.glob("*.jsonl")):
        for text in p.read_text().splitlines():
            if text.strip():
                rec = json.loads(text)
                (finals if rec.get("final") else lines).append(rec)
    return {"lines": lines, "finals": finals}


# ---- what a run shows ------------------------------------------------------------------------------------------------
def committed_steps(lines: list) -> dict:
    """{committed step index: the step's plan} from every group's committed lines; a ValueError when two groups
    logged different plans for one committed step (every contributor must compute the same plan)."""
    steps: dict = {}
    for rec in lines:
        if rec["committed"] and rec["plan"] is not None and rec["rank"] == 0:
            k = rec["committed_before"]
            plan = {"contributors": rec["plan"][0], "items": rec["plan"][1], "loss_tokens": rec["loss_tokens"]}
            if steps.setdefault(k, plan) != plan:
                raise ValueError(f"committed step {k}: the groups logged different plans: {steps[k]} / {plan}")
    return steps


def coverage(steps: dict, lengths) -> dict:
    """Tokens of every document over the committed steps: {"lost": docs with a token in no step, "duplicated":
    docs with a token in two or more, "steps": count, "gaps": missing committed step indices}."""
    seen = np.zeros(int(np.sum(lengths)), dtype=np.int64)
    offset = np.concatenate([[0], np.cumsum(lengths)])
    for plan in steps.values():
        for mine in plan["items"]:
            for mb in mine:
                for piece in mb:
                    d, a, b = (piece[0], 0, int(lengths[piece[0]])) if len(piece) == 1 else piece
                    seen[offset[d] + a : offset[d] + b] += 1
    per_doc_min = np.minimum.reduceat(seen, offset[:-1])
    per_doc_max = np.maximum.reduceat(seen, offset[:-1])
    gaps = sorted(set(range(max(steps) + 1)) - set(steps)) if steps else []
    return {
        "lost": int((per_doc_min == 0).sum()),
        "duplicated": int((per_doc_max > 1).sum()),
        "steps": len(steps),
        "gaps": gaps,
    }


def replay(cfg: Config, steps: dict):
    """The model after a single-process, unpacked run over the committed steps in order: per step, the sum of
    every document's token cross-entropy over the step's loss tokens, one SGD step."""
    import torch

    lengths = cfg.lengths()
    model = make_model(cfg.dim)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    for k in sorted(steps):
        pieces = [p for mine in steps[k]["items"] for mb in mine for p in mb]
        total = sum((int(lengths[p[0]]) if len(p) == 1 else p[2] - p[1]) - 1 for p in pieces)
        assert total == steps[k]["loss_tokens"], (k, total, steps[k]["loss_tokens"])
        loss = 0.0
        for p in pieces:
            d, a, b = (p[0], 0, int(lengths[p[0]])) if len(p) == 1 else p
            ids = tokens_of(d, int(lengths[d]))[a:b]
            logits = doc_logits(model, ids)
            loss = loss + torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="sum")
        (loss / total).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def states_agree(lines: list) -> dict:
    """{(group rank, committed step count): the set of data-state digests the groups logged after it}: one digest
    each. Per group rank: under async quorum torchft's first step (init_sync) heals every rank of all groups but
    one from a source chosen per rank, so the ranks of one group may see different single contributors there (the
    same plan: one group takes the whole step) and record different members."""
    seen: dict = {}
    for rec in lines:
        if rec["committed"]:
            seen.setdefault((rec["rank"], rec["committed_after"]), set()).add(rec["state"])
    return seen


if __name__ == "__main__" and len(sys.argv) == 6 and sys.argv[1] == "--worker":
    sys.path.insert(0, str(ROOT))
    config = Config(**json.loads(Path(sys.argv[2]).read_text()))
    worker(config, int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
