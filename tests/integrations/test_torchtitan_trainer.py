"""torchtitan's own Trainer (0.3.0) running on CPU gloo, float32, at DP 2 and at CP 2, fed by BalancedDataLoader (its
`config.dataloader`) with PackedAttention in the llama3 model: it trains to the end of the data, every document
exactly once, and its loss is normalised by its own global token count, which equals the plan's loss tokens of the
step.

torchtitan 0.3.0 targets GPUs; the test-side shims that let its Trainer run on a CPU (none of them touches the
data path or the loss):
  1. `cpu_device`: torchtitan's device type falls back to "cuda" and its device module to `torch.cuda`; set to "cpu"
     and a device module with the calls torchtitan makes (`get_device_name`, memory statistics, `synchronize`...)
     that `torch.cpu` lacks;
  2. `no_pg_timeouts`: `set_pg_timeouts` calls `torch.distributed.set_timeout` (absent in torch 2.13) after a
     `barrier(device_ids=...)`; replaced by a plain barrier;
  3. `sum_reduction`: FSDP reduces with `ReduceOp.PREMUL_SUM`, which gloo refuses; every FSDP module is set to
     `set_force_sum_reduction_for_comms(True)` after torchtitan's own `parallelize_fn` (torchtitan already sets the
     gradient divide factor to 1: a plain sum);
  4. settings: `parallelism.spmd_backend = "partial_dtensor"` (the default `spmd_types` backend fails FSDP setup on
     CPU), `training.mixed_precision_param = "float32"` (bfloat16 by default), no activation checkpointing.
"""

from __future__ import annotations

import dataclasses
import json
import types

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed (tools/setup.sh test installs 0.3.0)")

import numpy as np
import torch
from support.dist import run_world

from balancer.integrations.torchtitan import BalancedDataLoader, use_packed_attention

VOCAB, SEQ, LBS = 256, 64, 2
IGNORE = -100


class CpuDeviceModule(types.SimpleNamespace):
    """What torchtitan calls on its device module, for the CPU (shim 1)."""

    def __init__(self) -> None:
        props = types.SimpleNamespace(total_memory=1 << 34, name="cpu")
        super().__init__(
            set_device=lambda *a: None, current_device=lambda: 0, get_device_name=lambda *a: "cpu",
            get_device_properties=lambda *a: props, reset_peak_memory_stats=lambda *a: None,
            empty_cache=lambda: None, synchronize=lambda *a: None, device_count=lambda: 1,
            memory_stats=lambda *a: {"active_bytes.all.peak": 0, "active_bytes.all.current": 0,
                                     "reserved_bytes.all.peak": 0, "num_alloc_retries": 0, "num_ooms": 0},
            is_available=lambda: True, manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed,
        )  # fmt: skip


def cpu_device() -> None:
    """Shim 1: every loaded torchtitan module's `device_type` / `device_module` -> "cpu" / CpuDeviceModule."""
    import sys

    import torchtitan.trainer  # noqa: F401  (loads the modules that copy the names)

    module = CpuDeviceModule()
    for name, mod in list(sys.modules.items()):
        if name.startswith("torchtitan") and mod is not None:
            if getattr(mod, "device_type", None) == "cuda":
                mod.device_type = "cpu"
            if getattr(mod, "device_module", None) is torch.cuda:
                mod.device_module = module


def no_pg_timeouts() -> None:
    """Shim 2."""
    import torch.distributed as dist
    import torchtitan.trainer as tt

    tt.dist_utils.set_pg_timeouts = lambda timeout, parallel_dims: dist.barrier()


def sum_reduction(parallelize_fn):
    """Shim 3: torchtitan's parallelize_fn, then plain-sum gradient reduction on every FSDP module."""
    from torch.distributed.fsdp import FSDPModule

    def parallelize(model, **kwargs):
        model = parallelize_fn(model, **kwargs)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
        return model

    return parallelize


def trainer_config(path: str, tokenizer: str, out: str, cp_degree: int):
    from test_torchtitan_training import tiny_model_config
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.models.llama3 import model_registry
    from torchtitan.trainer import Trainer

    spec = model_registry("debugmodel")
    spec = dataclasses.replace(spec, model=use_packed_attention(tiny_model_config()),
                               parallelize_fn=sum_reduction(spec.parallelize_fn))  # fmt: skip
    return Trainer.Config(
        model_spec=spec, hf_assets_path=tokenizer, dump_folder=out,
        loss=CrossEntropyLoss.Config(global_vocab_size=VOCAB), optimizer=default_adamw(lr=1e-3),
        training=TrainingConfig(local_batch_size=LBS, seq_len=SEQ, steps=1000, global_batch_size=8,
                                mixed_precision_param="float32", dtype="float32"),
        dataloader=BalancedDataLoader.Config(dataset_path=path, global_batch_size=8, cp_degree=cp_degree,
                                             cost={"attn_coef": 1.0, "linear_coef": 40.0}),
        metrics=MetricsProcessor.Config(log_freq=1),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        activation_checkpoint=None,
    )  # fmt: skip


def trainer_worker(rank: int, world: int, path: str, tokenizer: str, out: str, cp_degree: int) -> None:
    """torchtitan's Trainer (shims 1-4) trained to the end of the data; each rank records what it was fed and the
    trainer's global token count of every step."""
    import os

    os.environ["LOCAL_RANK"] = str(rank)  # what torchrun sets; the process group is already up (run_world)
    cpu_device()
    no_pg_timeouts()
    from torchtitan.trainer import Trainer

    fed, counts = [], []

    class Recording(Trainer):
        def batch_generator(self, data_iterable):
            for input_dict, labels in super().batch_generator(data_iterable):
                fed.append((input_dict["input"][0].tolist(), input_dict["positions"][0].tolist(),
                            int((labels != IGNORE).sum())))  # fmt: skip
                yield input_dict, labels

        def forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
            counts.append(int(global_valid_tokens))
            return super().forward_backward_step(input_dict=input_dict, labels=labels,
                                                 global_valid_tokens=global_valid_tokens)  # fmt: skip

    trainer = Recording(trainer_config(path, tokenizer, f"{out}/dump", cp_degree))
    try:
        trainer.train()
    finally:
        trainer.close()
    loader = trainer.dataloader
    plan = [loader.sampler.step_loss_tokens(s) for s in range(loader.sampler.num_steps)]
    record = {"fed": fed, "counts": counts, "plan": plan, "steps": trainer.step, "m": loader.micro_batches}
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(record, f)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    import datasets
    from support.data_files import make_texts, train_hf_tokenizer

    root = tmp_path_factory.mktemp("trainer")
    train_hf_tokenizer(root / "tok", make_texts(20, max_words=8), vocab_size=VOCAB)
    rng = np.random.default_rng(7)
    rows = [rng.integers(0, VOCAB, size=int(n)).tolist() for n in rng.integers(3, 60, size=40)]
    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(str(root / "docs"))
    return str(root / "docs"), str(root / "tok"), rows


def documents(fed: list) -> list[list[int]]:
    """The documents of the fed items (split where positions restart), fillers (no loss token) left out."""
    out = []
    for ids, pos, loss_tokens in fed:
        if loss_tokens == 0:
            continue
        starts = [i for i, p in enumerate(pos) if p == 0] + [len(ids)]
        out += [ids[a:b] for a, b in zip(starts[:-1], starts[1:])]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("cp_degree", [1, 2], ids=["dp2", "cp2"])
def test_torchtitan_trainer_on_the_balanced_loader(corpus, cp_degree, tmp_path):
    """DP 2: two replicas; CP 2: one replica whose micro-batches are split over both ranks (zigzag) and attended
    by PackedAttention over the CP group the loader made."""
    path, tokenizer, rows = corpus
    run_world(2, trainer_worker, path, tokenizer, str(tmp_path), cp_degree)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    plan = ranks[0]["plan"]
    for rec in ranks:
        assert rec["steps"] == len(plan) + 1  # the last step found the data exhausted ("Ran out of data")
        assert rec["counts"] == [c for c in plan for _ in range(rec["m"])]  # torchtitan's count = the plan's
        assert len(rec["fed"]) == len(plan) * rec["m"]
    assert sum(n for rec in ranks for _, _, n in rec["fed"]) == sum(plan) == sum(len(r) - 1 for r in rows)
    if cp_degree == 1:
        assert sorted(documents(ranks[0]["fed"]) + documents(ranks[1]["fed"])) == sorted(rows)
    else:  # both ranks hold shares of the same micro-batches: together, every token of every document once
        tokens = sorted(t for rec in ranks for ids, _, n in rec["fed"] if n for t in ids)
        assert tokens == sorted(t for r in rows for t in r)
