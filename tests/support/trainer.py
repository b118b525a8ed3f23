"""Tiny Llama models, token data and torchrun-style process worlds for the Trainer integration tests."""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from support.dist import free_port, leave_without_finalization

VOCAB = 64


def tiny_llama(attn: str = "sdpa", seed: int = 0, vocab_size: int = VOCAB):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation=attn,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def token_rows(n_docs: int, seed: int, max_len: int = 40) -> list[list[int]]:
    """`n_docs` random token documents of 1..max_len tokens (one of 1 token: no loss token)."""
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([[1, max_len], rng.integers(2, max_len + 1, n_docs - 2)])
    rng.shuffle(lengths)
    return [rng.integers(0, VOCAB, int(n)).tolist() for n in lengths]


# One plain SGD step per optimizer step: lr 1, no clipping, no decay, constant schedule, no reporting, CPU.
PLAIN_SGD = dict(
    optim="sgd",
    learning_rate=1.0,
    lr_scheduler_type="constant",
    weight_decay=0.0,
    max_grad_norm=0.0,
    num_train_epochs=1,
    per_device_train_batch_size=1,
    save_strategy="no",
    report_to=[],
    use_cpu=True,
    disable_tqdm=True,
    logging_strategy="no",
)


def training_args(output_dir, **overrides):
    """TrainingArguments of PLAIN_SGD, with `overrides`."""
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(output_dir), **{**PLAIN_SGD, **overrides})


def unpacked_sgd_delta(model, rows, labels=None) -> dict:
    """Weight change of one SGD step (lr 1) on the mean token loss over all documents, one document at a time."""
    total, count = 0.0, 0
    for i, ids in enumerate(rows):
        x = torch.tensor(ids)[None]
        target = torch.tensor(labels[i] if labels is not None else ids)[1:]
        logits = model(input_ids=x).logits[0, :-1]
        total = total + torch.nn.functional.cross_entropy(logits.float(), target, ignore_index=-100, reduction="sum")
        count += int((target != -100).sum())
    (total / count).backward()
    return {n: -p.grad.detach().clone() for n, p in model.named_parameters()}


def relative_error(got: dict, want: dict) -> float:
    num = sum(float((got[n] - want[n]).double().pow(2).sum()) for n in want)
    den = sum(float(want[n].double().pow(2).sum()) for n in want)
    return (num / den) ** 0.5


def _env_entry(rank: int, world: int, port: int, fn, args) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    try:
        fn(rank, world, *args)
        if dist.is_initialized():
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    leave_without_finalization()


def run_torchrun_world(world: int, fn, *args) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned processes with torchrun's environment (RANK, WORLD_SIZE,
    MASTER_ADDR/PORT): the Trainer (accelerate) initialises the gloo process group itself, as under torchrun."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_env_entry, args=(world, free_port(), fn, args), nprocs=world, join=True)
