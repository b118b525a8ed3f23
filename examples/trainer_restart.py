"""BalancedTrainer killed on N processes and restarted on M from its last checkpoint, every document once.

    torchrun --nproc-per-node 3 examples/trainer_restart.py --out run/                  # dies, or is stopped
    torchrun --nproc-per-node 2 examples/trainer_restart.py --out run/ --resume         # from run/checkpoint-K

    torchrun --nnodes 1:2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint NODE0:29500 --rdzv-id run1 \
        --rdzv-conf is_host=1,join_timeout=180,last_call_timeout=8,keep_alive_interval=1,keep_alive_max_attempt=5 \
        --max-restarts 1 examples/trainer_restart.py --out run/ --resume-if-any   # elastic: every node, is_host=0
                                                                                   # on all but the store's

Under torchrun's elastic agents every (re)start runs the same command: `--resume-if-any` resumes from the last
complete checkpoint when there is one and starts the run otherwise. A checkpoint is complete when its
`trainer_state.json` is there (the Trainer writes it last; the balanced sampler's state is written before the
Trainer's own files), so a folder left half-written by a process killed while saving is skipped.

The topology follows the world size (`dp = WORLD_SIZE`) and keeps `tokens_per_step`, so the relaunched job trains
the same global batch with more micro-batches per rank; `trainer.train(resume_from_checkpoint=...)` loads the
Trainer's checkpoint and the balanced sampler's state in it (`balancer_sampler.json`), which plans the rest of the
window for the new DP size: nothing lost, nothing repeated (docs/fault-tolerance.md). The model is a tiny Llama
built from its config (no download). `--trace DIR` writes what every rank trained, one JSON line per optimizer step
(tests/integrations/test_trainer_restart.py checks it: document d's tokens are all `d + 1`, so a step's tokens name
its documents, with the elastic restart count and the checkpoint resumed from); `--die-at STEP` kills the last rank
(SIGKILL) at the end of that step of a first launch; `--hold-at STEP` makes every rank given it write
`held-rank<R>` into the trace folder at the end of that step of a first start and wait there, to be killed from
outside with its node (tests/integrations/test_elastic_trainer.py).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import time
from pathlib import Path

import numpy as np


def lengths_of(n: int) -> np.ndarray:
    rng = np.random.default_rng(11)
    return np.minimum(rng.lognormal(3.0, 0.8, n).astype(np.int64) + 2, 96)


def rows_of(n: int) -> list[list[int]]:
    """Document d: `lengths_of(n)[d]` tokens, each `d + 1` (token 0 is never a document's)."""
    return [[d + 1] * int(length) for d, length in enumerate(lengths_of(n))]


def tiny_model(vocab: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    return LlamaForCausalLM(cfg)


def last_checkpoint(out: Path) -> str | None:
    """The last complete checkpoint-K folder in `out` (its trainer_state.json written), None when there is none."""
    found = [
        p for p in out.glob("checkpoint-*") if p.name.split("-")[1].isdigit() and (p / "trainer_state.json").exists()
    ]
    return str(max(found, key=lambda p: int(p.name.split("-")[1]))) if found else None


def build(args, rank: int, world: int, resumed: str | None):
    """The trainer of this world size, recording each optimizer step's tokens per document when tracing."""
    import datasets
    import transformers

    import balancer
    import balancer.hf

    class Traced(balancer.hf.BalancedTrainer):
        seen: collections.Counter = collections.Counter()

        def compute_loss(self, model, inputs, **kwargs):
            self.seen.update(int(t) - 1 for t in inputs["input_ids"].flatten().tolist())
            return super().compute_loss(model, inputs, **kwargs)

    class Trace(transformers.TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            if args.trace:
                restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # torchrun's elastic agent's
                line = {"rank": rank, "world": world, "step": state.global_step, "tokens": dict(trainer.seen),
                        "restart": restarts, "resumed": resumed}  # fmt: skip
                with open(Path(args.trace) / f"rank{rank}_world{world}.jsonl", "a") as f:
                    f.write(json.dumps(line) + "\n")
            trainer.seen.clear()
            if state.global_step == args.die_at and resumed is None and rank == world - 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if state.global_step == args.hold_at and resumed is None:
                (Path(args.trace) / f"held-rank{rank}").touch()
                while True:  # until killed from outside, with the node (the peers wait in the next reduction)
                    time.sleep(1)

    rows = rows_of(args.docs)
    topo = balancer.Topology(dp=world, micro_batches=-(-6 // world), max_tokens=128, tokens_per_step=600)
    targs = transformers.TrainingArguments(
        output_dir=args.out, optim="sgd", learning_rate=0.05, lr_scheduler_type="constant", num_train_epochs=1,
        per_device_train_batch_size=1, save_strategy="steps", save_steps=args.save_every, report_to=[],
        use_cpu=True, disable_tqdm=True, logging_strategy="no", seed=0,
    )  # fmt: skip
    trainer = Traced(model=tiny_model(args.docs + 1), args=targs, topology=topo, seed=3,
                     train_dataset=datasets.Dataset.from_dict({"input_ids": rows}), callbacks=[Trace()])  # fmt: skip
    return trainer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--docs", type=int, default=240)
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--trace", default=None)
    ap.add_argument("--die-at", type=int, default=-1)
    ap.add_argument("--hold-at", type=int, default=-1, help="after tracing this step of a first start, wait (tests)")
    ap.add_argument("--resume", action="store_true", help="resume from the last complete checkpoint-* in --out")
    ap.add_argument("--resume-if-any", action="store_true", help="resume if there is one, else start (elastic)")
    args = ap.parse_args()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    resumed = last_checkpoint(Path(args.out)) if (args.resume or args.resume_if_any) else None
    if args.resume and resumed is None:
        raise FileNotFoundError(f"--resume: no complete checkpoint-* (with trainer_state.json) in {args.out}")
    trainer = build(args, rank, world, resumed)
    trainer.train(resume_from_checkpoint=resumed)
    import torch.distributed as dist

    if dist.is_initialized():  # every rank tears the process group down together, none while a peer works
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
