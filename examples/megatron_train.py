#!/usr/bin/env python
"""Train a megatron-core GPTModel on a balanced plan: pretokenized folder -> plan -> (dynamic) CP attention (gloo).

    python examples/megatron_train.py --data tok/ --dp 2 --cp 2 --steps 3            # static CP 2 on 4 ranks
    python examples/megatron_train.py --data tok/ --dp 4 --cp-sizes 1 2 4 --steps 3  # dynamic CP over a pool of 4
    python examples/megatron_train.py --steps 2                                       # synthetic corpus, pretokenized

Per rank (rank = dp_rank * cp + cp_rank, Megatron's own order for tp = pp = 1): Megatron's `parallel_state`, a
`BalancedBatchSampler` over the folder's lengths index, every CP process group the plan may use
(`balancer.cp_groups`), a `BalancedScheduler` that hands out per step `num_microbatches` and a data iterator of
`megatron_batch` dicts with their `PackedSeqParams` (the micro-batch's CP group included), and a `GPTModel` whose
core attention is `CPCoreAttention` (the project's exact CP attention on packed documents, no Transformer Engine).
The loss is a per-token cross-entropy normalised by the step's global loss-token count (the plan knows it);
gradients are summed over all DP x CP ranks.

The step loop is the one of Megatron's `forward_backward_no_pipelining` (forward_step_func per micro-batch, backward,
`num_microbatches` times): on a machine with CUDA pass the same `data_iterator` and `num_microbatches` to
`megatron.core.pipeline_parallel.get_forward_backward_func()` instead (docs/megatron.md); its schedules allocate a
CUDA tensor, so this CPU example runs the loop itself.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=None, help="a `balancer pretokenize` folder (default: a synthetic one)")
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--cp-sizes", type=int, nargs="*", default=None, help="dynamic CP: group sizes of the pool")
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per rank per micro-batch")
    p.add_argument("--layout", choices=("zigzag", "sequence", "hybrid"), default="hybrid")
    p.add_argument("--method", choices=("ring", "allgather", "ulysses"), default="ring")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--docs", type=int, default=200, help="synthetic corpus size (without --data)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-json", default=None, help="also write the per-step log as JSON lines here (rank 0)")
    return p.parse_args(argv)


def synthetic_folder(n: int, seed: int, out: Path) -> Path:
    """A corpus of `n` texts with a heavy tail of lengths, pretokenized with the byte tokenizer into `out`."""
    from balancer.cli import main as balancer_main

    rng = np.random.default_rng(seed)
    words = "the quick brown fox jumps over a lazy dog balancing long context attention across ranks".split()
    lens = np.minimum(rng.lognormal(3.0, 1.0, n).astype(int) + 2, 120)
    src = out.parent / "corpus.jsonl"
    with open(src, "w") as f:
        for k in lens:
            f.write(json.dumps({"text": " ".join(rng.choice(words, int(k)))}) + "\n")
    if balancer_main(["pretokenize", str(src), "--output", str(out), "--add-eos", "--quiet"]) != 0:
        raise SystemExit("megatron_train.py: pretokenizing the synthetic corpus failed")
    return out


def build_model(args, vocab: int):
    """A GPTModel (learned absolute positions: Megatron's rotary moves its table to CUDA) with CPCoreAttention."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from balancer.integrations.megatron import CPCoreAttention

    cfg = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=4, num_query_groups=2,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, calculate_per_token_loss=True,
    )  # fmt: skip
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = CPCoreAttention.using(args.method)
    torch.manual_seed(args.seed)
    longest = args.max_tokens * max(args.cp_sizes or [args.cp])
    return GPTModel(
        cfg, spec, vocab_size=vocab, max_sequence_length=longest, position_embedding_type="learned_absolute"
    )


def forward_step(data_iterator, model):
    """Megatron's `forward_step_func` contract: the model's output and a loss function of it."""
    batch = next(data_iterator)
    logits = model(batch["tokens"], batch["position_ids"], None, packed_seq_params=batch["packed_seq_params"])

    def loss_func(output):
        lp = torch.log_softmax(output[0].float(), -1).gather(-1, batch["labels"][0][:, None])[:, 0]
        loss = -(lp * batch["loss_mask"][0]).sum()
        return loss, batch["loss_mask"].sum().to(torch.int), {"loss": loss.detach(), "cp_size": batch["cp_size"]}

    return logits, loss_func


def run_step(step, model) -> tuple[float, list[int]]:
    """One step's micro-batches, forward and backward, as Megatron's no-pipelining schedule runs them: the summed
    token loss of this rank and the CP group size of every micro-batch."""
    total, sizes = 0.0, []
    for _ in range(step.num_microbatches):
        output, loss_func = forward_step(step.data_iterator, model)
        loss, _, info = loss_func(output)
        loss.backward()
        total += float(info["loss"])
        sizes.append(info["cp_size"])
    return total, sizes


def setup(args):
    """Megatron's model-parallel state, the data, the plan and the scheduler of this rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import balancer
    from balancer.integrations.megatron import BalancedScheduler

    ps.initialize_model_parallel(1, 1, context_parallel_size=1 if args.cp_sizes else args.cp)
    model_parallel_cuda_manual_seed(args.seed, inference_rng_tracker=True)  # the CPU path of Megatron's RNG setup
    dataset = balancer.ShardDataset(args.data)
    vocab = int(dataset.manifest["tokenizer"]["vocab_size"])
    topo = balancer.Topology(
        dp=args.dp, cp=args.cp, micro_batches=args.micro_batches, max_tokens=args.max_tokens,
        cp_sizes=tuple(args.cp_sizes) if args.cp_sizes else None,
    )  # fmt: skip
    cost = balancer.CostModel.from_model(
        hidden_size=args.hidden, num_layers=args.layers, num_heads=4, num_kv_heads=2, vocab_size=vocab
    )
    sampler = balancer.BalancedBatchSampler(args.data, topo, cost, rank=dist.get_rank(), seed=args.seed,
                                            overflow="split")  # fmt: skip
    groups = balancer.cp_groups(topo)
    return BalancedScheduler(sampler, dataset, layout=args.layout, groups=groups), vocab


def worker(args) -> None:
    scheduler, vocab = setup(args)
    model = build_model(args, vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    log = open(args.log_json, "w") if (args.log_json and dist.get_rank() == 0) else None
    done, epoch = 0, 0
    while done < args.steps:
        scheduler.set_epoch(epoch)
        for step in scheduler:
            loss, sizes = run_step(step, model)
            flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()] + [torch.tensor([loss])])
            dist.all_reduce(flat)  # sum over every DP x CP rank, then the step's global loss-token count
            off = 0
            for p in model.parameters():
                p.grad.copy_(flat[off : off + p.numel()].view_as(p) / step.loss_tokens)
                off += p.numel()
            opt.step()
            opt.zero_grad(set_to_none=False)
            rec = {
                "epoch": epoch,
                "step": step.step,
                "loss": float(flat[-1]) / step.loss_tokens,
                "num_microbatches": step.num_microbatches,
                "loss_tokens": step.loss_tokens,
                "cp_sizes": sizes,
            }
            if dist.get_rank() == 0:
                print(f"step {done} (epoch {epoch} step {step.step}) loss {rec['loss']:.4f} micro-batches "
                      f"{step.num_microbatches} CP group sizes of rank 0 {sizes}", flush=True)  # fmt: skip
                if log:
                    log.write(json.dumps(rec) + "\n")
            done += 1
            if done >= args.steps:
                break
        epoch += 1
    if log:
        log.close()
    if dist.get_rank() == 0:
        print("done", flush=True)


def _spawned(local_rank: int, args, port: int, world: int) -> None:
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|absl).*")
    os.environ.update(RANK=str(local_rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    try:
        worker(args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    args = parse_args(argv)
    world = args.dp * args.cp
    with tempfile.TemporaryDirectory() as tmp:
        if args.data is None:
            args.data = str(synthetic_folder(args.docs, args.seed, Path(tmp) / "tok"))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        torch.multiprocessing.spawn(_spawned, args=(args, port, world), nprocs=world, join=True)


if __name__ == "__main__":
    main()
