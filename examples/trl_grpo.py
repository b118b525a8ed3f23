#!/usr/bin/env python
"""TRL's GRPOTrainer on balanced, packed micro-batches (balancer.integrations.trl_grpo.BalancedGRPOTrainer).

    python examples/trl_grpo.py                                  # one process, CPU, the model generates
    torchrun --nproc-per-node 2 examples/trl_grpo.py             # two processes (gloo on CPU)

A tokenizer and a tiny Llama are made on the spot (no download); the reward is local (longer completions score
higher); no vLLM. Each generation batch is planned over this rank's micro-batches by `balance_batch` and packed
without padding; the loss keeps the stock normalisation of `loss_type`. See docs/trl-grpo.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def reward_length(completions, **kwargs) -> list[float]:
    """A local reward function: the completion's length in characters."""
    return [float(len(c)) for c in completions]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps")
    p.add_argument("--loss-type", default="dapo", help="GRPOConfig.loss_type (grpo, dr_grpo, dapo, luspo, ...)")
    p.add_argument("--output", default="grpo_output", help="checkpoints, logs and the tiny model")
    args = p.parse_args(argv)

    import datasets
    from post_training_common import texts, tiny_model
    from transformers import AutoTokenizer
    from trl import GRPOConfig

    from balancer.integrations.trl_grpo import BalancedGRPOTrainer

    folder = tiny_model(Path(args.output) / "model", eos_every=10)
    config = GRPOConfig(args.output, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                        num_generations=4, max_completion_length=16, max_steps=args.steps, logging_steps=1,
                        loss_type=args.loss_type, report_to=[], use_cpu=True, bf16=False,
                        save_strategy="no")  # fmt: skip
    trainer = BalancedGRPOTrainer(
        model=str(folder),
        reward_funcs=[reward_length],
        args=config,
        train_dataset=datasets.Dataset.from_dict({"prompt": texts(32, seed=2, max_words=6)}),
        processing_class=AutoTokenizer.from_pretrained(str(folder)),
    )
    result = trainer.train()
    print(f"done: {trainer.state.global_step} steps, train_loss {result.training_loss:.4f}")


if __name__ == "__main__":
    main()
