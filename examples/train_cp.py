#!/usr/bin/env python
"""Train a small transformer with balanced DP x CP data and exact context-parallel attention (gloo on CPU).

    python examples/train_cp.py --dp 2 --cp 2 --steps 5             # spawns its own 4 processes
    torchrun --nproc-per-node 4 examples/train_cp.py --dp 2 --cp 2  # or torchrun-style env ranks
    python examples/train_cp.py --data tok/ --overflow split ...    # a `balancer pretokenize` folder (any tokenizer)

Ranks: rank = dp_rank * cp + cp_rank (DP outermost, as `BalancedBatchSampler` assumes without an explicit dp_rank).
Per rank: `BalancedBatchSampler` (this DP rank's micro-batches) -> `PackedCollator` (this CP rank's share) -> a
transformers LlamaForCausalLM (tiny config, random init; vocabulary from the folder's manifest, or bytes) whose
attention is `attention.cp_attention` (registered through `attention.hf`) -> `balancer.loss.token_loss` normalised
by the step's global loss-token count from the plan -> gradients summed over all DP x CP ranks -> AdamW.

Logged per step (rank 0): loss, tokens, predicted per-replica time (cost model, scaled to seconds by the run's
measured/predicted ratio so far) vs measured (forward+backward seconds, max over the replica's CP ranks), and the step
imbalance (slowest replica / mean replica), predicted and measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

BYTE_VOCAB = 257  # the synthetic corpus: bytes 0..255, EOS 256


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=512, help="tokens per CP rank per micro-batch")
    p.add_argument("--tokens-per-step", type=int, default=None, help="global batch in tokens (default 85%% cap)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--docs", type=int, default=400, help="synthetic corpus size (without --data)")
    p.add_argument(
        "--data", default=None, help="a pretokenized folder (balancer pretokenize); its manifest gives the vocabulary"
    )
    p.add_argument(
        "--overflow",
        choices=("error", "split", "truncate"),
        default="error",
        help="documents longer than max_tokens*cp: error (default), split into windows, or truncate",
    )
    p.add_argument("--method", choices=("ring", "allgather"), default="ring")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--log-json", default=None, help="also write the per-step log as JSON lines here (rank 0)")
    return p.parse_args(argv)


def synthetic_corpus(n: int, seed: int, max_len: int) -> list[dict]:
    """Byte-level documents with a heavy tail of lengths (most short, a few near the micro-batch cap)."""
    rng = np.random.default_rng(seed)
    lens = np.minimum(rng.lognormal(4.0, 0.9, n).astype(np.int64) + 1, max_len)
    lens[rng.choice(n, max(1, n // 50), replace=False)] = rng.integers(max_len // 2, max_len + 1, max(1, n // 50))
    words = b"the quick brown fox jumps over a lazy dog balancing long context attention across ranks ".split()
    docs = []
    for d in lens:
        text = b" ".join(words[i] for i in rng.integers(0, len(words), int(d)))[: int(d) - 1] + b"\n"
        ids = np.frombuffer(text, dtype=np.uint8).astype(np.int64)
        docs.append({"input_ids": torch.from_numpy(np.append(ids, 256)[: int(d)])})  # EOS at the end
    return docs


def worker(args) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    import attention.hf as ahf
    from balancer.planning.cost.model import CostModel
    from balancer.planning.topology import Topology
    from balancer.training.collate import PackedCollator
    from balancer.training.indices import SpanDataset
    from balancer.training.loss import token_loss
    from balancer.training.sampler import BalancedBatchSampler

    torch.set_num_threads(args.threads)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != args.dp * args.cp:
        raise SystemExit(f"world size {world} != dp*cp = {args.dp}*{args.cp}")
    dp_rank, cp_rank = divmod(rank, args.cp)
    cp_groups = [dist.new_group([d * args.cp + c for c in range(args.cp)]) for d in range(args.dp)]
    cp_group = cp_groups[dp_rank]

    topo = Topology(
        dp=args.dp,
        cp=args.cp,
        micro_batches=args.micro_batches,
        max_tokens=args.max_tokens,
        tokens_per_step=args.tokens_per_step,
    )
    if args.data:
        from balancer.data.shards.dataset import ShardDataset

        dataset = ShardDataset(args.data)
        vocab = int(dataset.manifest["tokenizer"]["vocab_size"])
    else:
        dataset = synthetic_corpus(args.docs, args.seed, topo.micro_batch_tokens)
        vocab = BYTE_VOCAB
    lengths = dataset.lengths if hasattr(dataset, "lengths") else np.array([len(d["input_ids"]) for d in dataset])
    if args.overflow != "error":  # parts of documents come as Span(doc, start, end): the wrapper cuts them out
        dataset = SpanDataset(dataset)

    ahf.register()
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max(2048, topo.micro_batch_tokens),
        attn_implementation=ahf.NAME,
    )
    cost = CostModel.from_config(cfg.to_dict())
    # dp_rank from torch.distributed
    sampler = BalancedBatchSampler(lengths, topo, cost, seed=args.seed, dataset=dataset, overflow=args.overflow)
    assert sampler.dp_rank == dp_rank
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, collate_fn=PackedCollator(cp_rank=cp_rank, cp_size=args.cp)
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if rank == 0:
        print(
            f"topology {topo}; {len(lengths)} documents, {int(lengths.sum())} tokens, "
            f"{sampler.num_steps} steps/epoch; attention {args.method}",
            flush=True,
        )

    log = open(args.log_json, "w") if (args.log_json and rank == 0) else None
    step_done, epoch = 0, 0
    pred_sum = meas_sum = 0.0
    while step_done < args.steps:
        sampler.set_epoch(epoch)
        busy, loss_acc = 0.0, 0.0
        for i, batch in enumerate(loader):
            step, m = sampler.step_of(i)
            t0 = time.perf_counter()
            with ahf.cp_context(batch["layout"], group=cp_group, method=args.method):
                logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
            loss = token_loss(logits, batch["labels"], sampler.step_info(step).loss_tokens)
            loss.backward()
            busy += time.perf_counter() - t0
            loss_acc += float(loss.detach())
            if m < topo.micro_batches - 1:
                continue
            # end of the optimizer step: sum gradients over all DP x CP ranks (the loss is globally normalised)
            flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()] + [torch.tensor([loss_acc])])
            dist.all_reduce(flat)
            off = 0
            for p in model.parameters():
                p.grad.copy_(flat[off : off + p.numel()].view_as(p))
                off += p.numel()
            opt.step()
            opt.zero_grad(set_to_none=False)
            times = torch.zeros(world, dtype=torch.float64)
            times[rank] = busy
            dist.all_reduce(times)
            measured = times.view(args.dp, args.cp).max(dim=1).values.numpy()
            info = sampler.step_info(step)
            pred = info.predicted["replica_times"]
            pred_sum += float(pred.sum())
            meas_sum += float(measured.sum())
            pred_s = pred * (meas_sum / pred_sum)  # cost units -> seconds, fitted on the run
            rec = {
                "epoch": epoch,
                "step": step,
                "loss": float(flat[-1]),
                "tokens": info.tokens,
                "loss_tokens": info.loss_tokens,
                "predicted_s": [round(float(x), 4) for x in pred_s],
                "measured_s": [round(float(x), 4) for x in measured],
                "predicted_imbalance": float(pred.max() / pred.mean()),
                "measured_imbalance": float(measured.max() / measured.mean()),
                "plan_vs_lower_bound": info.predicted["imbalance"],
            }
            if rank == 0:
                print(
                    f"step {step_done:3d} (epoch {epoch} step {step}) loss {rec['loss']:.4f} tokens "
                    f"{rec['tokens']:6d} | per-replica time predicted {rec['predicted_s']} measured "
                    f"{rec['measured_s']} | imbalance predicted {rec['predicted_imbalance']:.3f} measured "
                    f"{rec['measured_imbalance']:.3f}",
                    flush=True,
                )
                if log:
                    log.write(json.dumps(rec) + "\n")
                    log.flush()
            busy, loss_acc = 0.0, 0.0
            step_done += 1
            if step_done >= args.steps:
                break
        epoch += 1
    if log:
        log.close()
    if rank == 0:
        print("done", flush=True)


def _spawned(local_rank: int, args, port: int) -> None:
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(args.dp * args.cp),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    _run(args)


def _run(args) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    try:
        worker(args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def check_data(args) -> None:
    """Before any rank starts: a row of --data longer than a micro-batch without --overflow is one line naming the
    flags (exit 2), not a traceback from every spawned rank."""
    if not args.data:
        return
    from balancer.data.shards.lengths import read_lengths

    try:
        lengths = read_lengths(args.data)
    except (OSError, ValueError) as e:
        _fail(f"--data {args.data}: {e}")
    cap = args.max_tokens * args.cp
    if args.overflow == "error" and len(lengths) and int(lengths.max()) > cap:
        i = int(np.argmax(lengths))
        _fail(
            f"--data {args.data}: row {i} holds {int(lengths[i]):,} tokens, more than --max-tokens x --cp = "
            f"{args.max_tokens} x {args.cp} = {cap:,}; pass --overflow split (or truncate), or raise --max-tokens"
        )


def _fail(message: str) -> None:
    print(f"train_cp.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv=None) -> None:
    args = parse_args(argv)
    check_data(args)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        _run(args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.multiprocessing.spawn(_spawned, args=(args, port), nprocs=args.dp * args.cp, join=True)


if __name__ == "__main__":
    main()
