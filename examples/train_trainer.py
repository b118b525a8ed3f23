#!/usr/bin/env python
"""Train a tiny Llama with balancer.hf.BalancedTrainer (a transformers.Trainer) on balanced, packed DP x CP data.

    torchrun --nproc-per-node 4 examples/train_trainer.py --dp 2 --cp 2                # CPU: gloo
    accelerate launch --multi_gpu --num_processes 4 examples/train_trainer.py --dp 2 --cp 2  # GPUs (CPU: gloo)
    python examples/train_trainer.py --data tok/ --overflow split                       # one process, a folder

Ranks come from torch.distributed: rank = dp_rank * cp + cp_rank; the world size must be dp * cp. The data is a
`balancer pretokenize` folder (`--data`, vocabulary from its manifest) or a synthetic corpus of random tokens.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    p.add_argument("--cp", type=int, default=1, help="context-parallel ranks per replica")
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step (= gradient accumulation)")
    p.add_argument("--max-tokens", type=int, default=512, help="tokens per CP rank per micro-batch")
    p.add_argument("--data", default=None, help="a pretokenized folder (default: 200 synthetic documents)")
    p.add_argument("--overflow", choices=("error", "split", "truncate"), default="error", help="long documents")
    p.add_argument("--epochs", type=float, default=1.0, help="training epochs")
    p.add_argument("--output", default="trainer_output", help="checkpoints and logs")
    p.add_argument("--cpu", action="store_true", help="train on CPU even when a GPU is present")
    return p.parse_args(argv)


def main(argv=None) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    import balancer
    import balancer.hf

    args = parse_args(argv)
    if args.data:
        dataset = balancer.ShardDataset(args.data)
        vocab = int(dataset.manifest["tokenizer"]["vocab_size"])
    else:
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(2, args.max_tokens * args.cp, (200,), generator=g).tolist()
        dataset = [{"input_ids": torch.randint(0, 256, (n,), generator=g)} for n in lengths]
        vocab = 256
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max(2048, args.max_tokens * args.cp),
    )
    torch.manual_seed(0)
    topo = balancer.Topology(dp=args.dp, cp=args.cp, micro_batches=args.micro_batches, max_tokens=args.max_tokens)
    trainer = balancer.hf.BalancedTrainer(
        model=LlamaForCausalLM(config),
        args=TrainingArguments(
            args.output,
            num_train_epochs=args.epochs,
            learning_rate=1e-3,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=args.cpu or not torch.cuda.is_available(),
        ),
        train_dataset=dataset,
        lengths=None if args.data else lengths,
        topology=topo,
        overflow=args.overflow,
    )
    result = trainer.train()
    if trainer.is_world_process_zero():
        print(f"done: {result.global_step} steps, {topo}, final loss {result.training_loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
