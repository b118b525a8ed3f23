#!/usr/bin/env python
"""TRL's DPOTrainer on balanced, packed micro-batches (balancer.integrations.trl_dpo.BalancedDPOTrainer).

    python examples/trl_dpo.py                                   # one process, CPU
    torchrun --nproc-per-node 2 examples/trl_dpo.py              # two processes (gloo on CPU)

A tokenizer and a tiny Llama are made on the spot (no download); the preference pairs are random text. Every step's
pairs are planned over the processes and micro-batches by `balance_batch` (a pair's two sequences in one
micro-batch) and packed without padding; see docs/trl-dpo.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=32, help="preference pairs in the dataset")
    p.add_argument("--output", default="dpo_output", help="checkpoints, logs and the tiny model")
    args = p.parse_args(argv)

    import datasets
    from post_training_common import texts, tiny_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig

    from balancer.integrations.trl_dpo import BalancedDPOTrainer

    folder = tiny_model(Path(args.output) / "model")
    tok = AutoTokenizer.from_pretrained(str(folder))
    t = texts(3 * args.pairs, seed=1)
    n = args.pairs
    data = datasets.Dataset.from_dict({"prompt": t[:n], "chosen": t[n : 2 * n], "rejected": t[2 * n :]})
    config = DPOConfig(args.output, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_length=None,
                       num_train_epochs=1, logging_steps=1, report_to=[], use_cpu=True, bf16=False,
                       loss_type=["sigmoid"], save_strategy="no")  # fmt: skip
    trainer = BalancedDPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(str(folder)),
        ref_model=AutoModelForCausalLM.from_pretrained(str(folder)),
        args=config,
        train_dataset=data,
        processing_class=tok,
    )
    result = trainer.train()
    print(f"done: {trainer.state.global_step} steps, train_loss {result.training_loss:.4f}")


if __name__ == "__main__":
    main()
