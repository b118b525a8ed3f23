"""The in-world half of benchmarks/trainer_compare.py: one attention function for every contender, and one training
run of each contender (BalancedTrainer, stock Trainer with batch_rebalance or group_by_length, TRL SFTTrainer with
BFD packing), timed on every rank of a 2-process gloo world.

Every contender's attention is `attention.varlen_attention` (PyTorch's CPU flash-attention kernel, one piece per
document): BalancedTrainer through `attention.hf` (its own integration), the others through `flat_varlen_attention`
below, registered in transformers' AttentionInterface. It takes each row's documents from what the contender's
collator gives the model (a padded row's attention mask, a padding-free row's `cu_seq_lens_q` or position resets),
so no contender pays attention on padding or across documents: a padded batch still runs its padding through every
linear layer (that is its real cost), but its attention charges the sum of d^2, like everyone else's.
"""

from __future__ import annotations

import cProfile
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

FLAT = "flat_varlen"


def _row_docs(attention_mask, kwargs, batch: int, length: int) -> list[list[int]]:
    """Per row of the batch, the lengths of its documents, from the padding mask or the packing boundaries."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        if batch != 1:
            raise ValueError("cu_seq_lens_q with more than one row")
        return [np.diff(cu.cpu().numpy()).tolist()]
    pos = kwargs.get("position_ids")
    if pos is not None and batch == 1 and attention_mask is None:
        starts = np.flatnonzero(pos[0].cpu().numpy() == 0).tolist() + [length]
        return [np.diff(starts).tolist()] if starts[0] == 0 else [[length]]
    if attention_mask is None:
        return [[length]] * batch
    mask = attention_mask.bool()
    n = mask.sum(1)
    if not bool((mask == (torch.arange(length)[None] < n[:, None])).all()):
        raise ValueError("flat_varlen_attention takes right-padded rows only")
    return [[int(x)] for x in n]


def flat_varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention function: [B, H, T, D] rows of one document (padded right) or of packed documents ->
    `attention.varlen_attention` over the real tokens only; padded positions get zeros."""
    from attention.varlen import varlen_attention

    b, h, t, d = query.shape
    docs = _row_docs(attention_mask, kwargs, b, t)
    real = torch.zeros(b, t, dtype=torch.bool)
    for r, lens in enumerate(docs):
        real[r, : sum(lens)] = True
    flat = [x.transpose(1, 2)[real] for x in (query, key, value)]  # [N, heads, D]
    cu = torch.tensor([0] + np.cumsum([x for lens in docs for x in lens]).tolist(), dtype=torch.int32)
    out = varlen_attention(*flat, cu, True, scaling)
    full = out.new_zeros(b, t, h, d)
    full[real] = out
    return full, None


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    import attention.hf as ahf

    AttentionInterface.register(FLAT, flat_varlen_attention)
    AttentionMaskInterface.register(FLAT, ahf.padding_mask)  # the 2-D padding mask, untouched


class Counting:
    """Wraps a collator: counts the positions fed to the model and the real (non-padding) tokens among them."""

    def __init__(self, inner) -> None:
        self.inner, self.positions, self.real, self.batches = inner, 0, 0, 0

    def __call__(self, features):
        batch = self.inner(features)
        ids = batch["input_ids"]
        self.positions += int(ids.numel())
        mask = batch.get("attention_mask")
        self.real += int(mask.sum()) if mask is not None else int(ids.numel())
        self.batches += 1
        return batch


def build_model(cfg: dict, seed: int, attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**cfg, attn_implementation=attn))


def _args(job: dict, out: Path, **extra) -> dict:
    return dict(
        output_dir=str(out),
        optim="adamw_torch",
        learning_rate=job["lr"],
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        num_train_epochs=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        logging_strategy="steps",
        logging_steps=1,
        seed=job["seed"],
        data_seed=job["seed"],
        dataloader_num_workers=0,
        **extra,
    )


def make_trainer(job: dict, model, dataset, tokenizer, out: Path):
    """The contender's trainer, configured as its users would (see trainer_compare.py's docstring)."""
    name, m = job["contender"], job["micro_batches"]
    if name == "balancer":
        from transformers import TrainingArguments

        import balancer
        from balancer.trainers.trainer import BalancedTrainer

        topo = balancer.Topology(
            dp=job["dp"], micro_batches=m, max_tokens=job["max_tokens"], tokens_per_step=job["tokens_per_step"]
        )
        trainer = BalancedTrainer(model=model, args=TrainingArguments(**_args(job, out)), train_dataset=dataset,
                                  topology=topo)  # fmt: skip
        trainer.packed_collator = Counting(trainer.packed_collator)
        return trainer, trainer.packed_collator
    if name == "trl_bfd":
        from trl import SFTConfig, SFTTrainer

        cfg = SFTConfig(
            **_args(job, out, per_device_train_batch_size=1, gradient_accumulation_steps=m),  # one row per micro-batch
            packing=True,
            packing_strategy="bfd",
            padding_free=True,
            max_length=job["seq_length"],
            bf16=False,  # TRL's defaults: bf16 and gradient checkpointing; every contender runs fp32, no checkpointing
            gradient_checkpointing=False,
        )
        trainer = SFTTrainer(model=model, args=cfg, train_dataset=dataset, processing_class=tokenizer)
    else:
        from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

        strategy = {"hf_rebalance": "batch_rebalance", "hf_group": "group_by_length"}[name]
        args = TrainingArguments(
            **_args(job, out, per_device_train_batch_size=job["batch_size"], gradient_accumulation_steps=m),
            train_sampling_strategy=strategy,
        )
        collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
        trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator,
                          processing_class=tokenizer)  # fmt: skip
    trainer.data_collator = Counting(trainer.data_collator)
    return trainer, trainer.data_collator


@torch.no_grad()
def heldout_loss(model, docs: list[list[int]]) -> float:
    """Mean next-token loss over held-out documents, one document per forward, the same kernel for every model."""
    model.set_attn_implementation(FLAT)
    model.eval()
    total, count = 0.0, 0
    for ids in docs:
        x = torch.tensor(ids)[None]
        logits = model(input_ids=x).logits[0, :-1].float()
        total += float(torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum"))
        count += len(ids) - 1
    return total / count


def run_job(rank: int, job: dict, tmp: Path) -> dict | None:
    """One timed run of one contender on every rank; rank 0 returns the record."""
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp / "tokenizer")
    dataset = load_from_disk(str(tmp / job["mix"]))
    attn = FLAT
    model = build_model(job["model"], job["seed"], attn)
    out = tmp / f"run-{rank}"
    profiler = cProfile.Profile(time.process_time) if job.get("profile") else None  # CPU time
    dist.barrier()
    w0, c0 = time.perf_counter(), time.process_time()
    if profiler is not None:
        profiler.enable()
    trainer, counter = make_trainer(job, model, dataset, tokenizer, out)
    w1 = time.perf_counter()
    trainer.train()
    if profiler is not None:
        profiler.disable()
        tag = "warmup" if job.get("warmup") else f"rep{job['rep']}-seed{job['seed']}"
        profiler.dump_stats(Path(job["profile"]) / f"{job['mix']}-{job['contender']}-{tag}-rank{rank}.prof")
    dist.barrier()
    w2, c2 = time.perf_counter(), time.process_time()
    cpu = [None] * dist.get_world_size()
    dist.all_gather_object(cpu, [c2 - c0, counter.positions, counter.real, counter.batches])
    losses = [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e]
    steps = trainer.state.global_step
    if rank != 0:
        return None
    heldout = json.loads((tmp / f"{job['mix']}-heldout.json").read_text())
    return dict(
        job,
        wall_seconds=w2 - w0,
        setup_seconds=w1 - w0,
        cpu_seconds=float(sum(c[0] for c in cpu)),
        cpu_seconds_per_rank=[c[0] for c in cpu],
        positions=int(sum(c[1] for c in cpu)),
        real_tokens=int(sum(c[2] for c in cpu)),
        micro_batches_run=int(sum(c[3] for c in cpu)),
        steps=int(steps),
        losses=losses,
        heldout_loss=heldout_loss(trainer.model, heldout),
    )


def world(rank: int, size: int, tmp: str) -> None:
    """Run every job of tmp/jobs.json in order on this rank; rank 0 writes tmp/records.json (warm-up runs:
    tmp/warmup.json) after each run."""
    tmp = Path(tmp)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.logging.set_verbosity_error()
    register()
    if not dist.is_initialized():  # torchrun's environment is set: the Trainer finds this group and uses it
        dist.init_process_group("gloo")
    jobs = json.loads((tmp / "jobs.json").read_text())
    records, warmups = [], []
    for i, job in enumerate(jobs):
        rec = run_job(rank, job, tmp)
        if rank == 0:
            kept, name = (warmups, "warmup.json") if job.get("warmup") else (records, "records.json")
            kept.append(rec)
            (tmp / name).write_text(json.dumps(kept))
            what = "warm-up" if job.get("warmup") else f"rep {job['rep']}"
            print(
                f"[{i + 1}/{len(jobs)}] {job['mix']:<9} {job['contender']:<13} seed {job['seed']} {what}: "
                f"{rec['wall_seconds']:.1f} s wall, {rec['cpu_seconds']:.1f} s CPU, {rec['steps']} steps, "
                f"held-out loss {rec['heldout_loss']:.4f}",
                flush=True,
            )
