"""`BalancedDataLoader`: torchtitan's data loader on balanced, packed micro-batches.

    from balancer.integrations.torchtitan import BalancedDataLoader, use_packed_attention
    config.dataloader = BalancedDataLoader.Config(dataset_path="tok/", global_batch_size=64, cp_degree=2)

torchtitan's trainer builds one per rank (`config.dataloader.build(dp_world_size=..., dp_rank=..., tokenizer=...,
seq_len=..., local_batch_size=..., snapshot_every_n_steps=...)`); the plan's shape follows those arguments
(balancer.integrations.torchtitan.shape). Every item is one micro-batch of the balanced plan for this rank
(`BalancedBatchSampler`), packed and cut into this rank's CP share (`PackedCollator`) and handed over as
`(input_dict, labels)` (balancer.integrations.torchtitan.batches). Every step has exactly the trainer's count of
items on every rank: a short last step (fewer micro-batches in the plan) is completed with fully loss-masked
micro-batches. The end of the data ends the iteration (the trainer stops: "Ran out of data"), or with `infinite`
the next epoch starts (its own plan, seed + epoch).

`state_dict()` is the same on every rank (the sampler's resume state with the rank left out, and the filler
micro-batches already given in a short last step), so torchtitan's checkpointer stores it once; `load_state_dict`
resumes exactly, and a state saved after a finished step resumes onto another DP degree (the rest of the epoch is
planned again for the new topology: every document exactly once).

The loader is a `balancer.measured.StepSource`: every member is the sampler's it wraps, so
`balancer.BalanceMonitor(loader)` measures the balance of a torchtitan run (and, in adapt mode, refits its plans).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torchtitan.components.dataloader import BaseDataLoader

from balancer.integrations.torchtitan.batches import filler_batch, to_torchtitan
from balancer.integrations.torchtitan.cost import resolve_cost
from balancer.integrations.torchtitan.shape import plan_topology
from balancer.integrations.torchtitan.source import open_documents
from balancer.integrations.torchtitan.state import LoaderState
from balancer.planning.schedule import StepPlace
from balancer.planning.topology import Topology
from balancer.training.collate import PackedCollator
from balancer.training.indices import SpanDataset
from balancer.training.sampler import BalancedBatchSampler


class BalancedDataLoader(BaseDataLoader):
    """torchtitan data loader yielding this rank's balanced packed micro-batches (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        """`dataset_path`: a `balancer pretokenize` folder or a Hugging Face dataset folder; `dataset`: a Hugging
        Face dataset name / path (`load_dataset(dataset, split=split, **load_dataset_kwargs)`), read from `column`
        (token ids) or tokenized from `text_column` with the trainer's tokenizer. `global_batch_size`: the trainer's
        `training.global_batch_size`. `cp_degree`: CP group size (torchtitan's own CP left at 1); `pp_degree`: the
        pipeline stages (the plan's time model). `layout`: the CP layout ("zigzag", "contiguous", "hybrid").
        `cost` (a `CostModel.to_dict()`, e.g. `cost_for(model_config)`) or `cost_path` (a saved model).
        `overflow`: documents longer than a micro-batch ("error", "split", "truncate"). `attention_masks`: put the
        packed layout in the input dict for `PackedAttention` (False: positions only, for torchtitan's own
        flex / varlen attention without CP)."""

        split: str = "train"
        column: str = "input_ids"
        text_column: str = "text"
        load_dataset_kwargs: dict = field(default_factory=dict)
        global_batch_size: int = -1
        cp_degree: int = 1
        pp_degree: int = 1
        layout: str = "zigzag"
        tokens_per_step: Optional[int] = None
        cost: dict = field(default_factory=dict)
        cost_path: Optional[str] = None
        seed: int = 0
        window_docs: Optional[int] = None
        overflow: str = "error"
        pad_to_multiple_of: Optional[int] = None
        attention_masks: bool = True
        infinite: bool = False

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        seq_len: int,
        local_batch_size: int,
        tokenizer: Any = None,
        snapshot_every_n_steps: Optional[int] = None,
    ) -> None:
        """`snapshot_every_n_steps` is accepted for torchtitan's call and not needed: the loader runs in the
        training process and its state is exact after every item."""
        self.config = config
        self.topology = plan_topology(
            dp_world_size=dp_world_size, seq_len=seq_len, local_batch_size=local_batch_size,
            global_batch_size=config.global_batch_size, cp_degree=config.cp_degree, pp_degree=config.pp_degree,
            tokens_per_step=config.tokens_per_step,
        )  # fmt: skip
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_world_size {dp_world_size}")
        self.dp_world_size, self.batch_rank, self.seq_len = dp_world_size, dp_rank, seq_len
        self.cost = resolve_cost(config.cost, config.cost_path)
        documents, lengths = open_documents(
            config.dataset, config.dataset_path, split=config.split, column=config.column,
            text_column=config.text_column, load_dataset_kwargs=config.load_dataset_kwargs, tokenizer=tokenizer,
        )  # fmt: skip
        self.dataset = SpanDataset(documents)
        self.sampler = BalancedBatchSampler(
            lengths, self.topology, self.cost, rank=dp_rank, seed=config.seed, overflow=config.overflow,
            window_docs=config.window_docs,
        )  # fmt: skip
        if config.overflow == "error":
            _check_seq_len(self.sampler.lengths, seq_len)
        cp = self.topology.cp
        self.collator = PackedCollator(cp_rank=dp_rank % cp, cp_size=cp, layout=config.layout,
                                       pad_to_multiple_of=config.pad_to_multiple_of, dp_rank=dp_rank // cp)  # fmt: skip
        self.group = _cp_group(self.topology, dp_rank) if cp > 1 else None
        self._state = LoaderState(self.sampler, self.topology.micro_batches)

    @property
    def micro_batches(self) -> int:
        """Items per optimizer step (what the trainer pulls; the plan's `micro_batches`)."""
        return self.topology.micro_batches

    @property
    def step_source(self) -> BalancedBatchSampler:
        """The sampler this loader reads its plan from (the step source it delegates to)."""
        return self.sampler

    # ---- balancer.measured.StepSource: the wrapped sampler's members -------------------------------------------
    @property
    def monitor(self) -> Any:
        return self.sampler.monitor

    @monitor.setter
    def monitor(self, value: Any) -> None:
        self.sampler.monitor = value

    @property
    def pool_rank(self) -> int:
        return self.sampler.pool_rank

    @property
    def dp_rank(self) -> int:
        """The plan's DP replica of this rank (torchtitan's batch rank // cp_degree)."""
        return self.sampler.dp_rank

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    @property
    def position(self) -> int:
        return self.sampler.position

    def step_place(self, step: int) -> StepPlace:
        return self.sampler.step_place(step)

    def piece_sizes(self, step: int, m: int, dp_rank: Optional[int] = None, rank: Optional[int] = None) -> tuple:
        return self.sampler.piece_sizes(step, m, dp_rank=dp_rank, rank=rank)

    def plan_start(self, epoch: int, window: int) -> tuple[int, int]:
        return self.sampler.plan_start(epoch, window)

    def update_model(self, cost: Any, rank_speeds: Any, first_window: int, *, epoch: int) -> None:
        self.sampler.update_model(cost, rank_speeds, first_window, epoch=epoch)

    def __iter__(self) -> Iterator[tuple[dict, torch.Tensor]]:
        while True:
            for kind, indices in self._state.items():
                yield self._item(kind, indices)
            if not self.config.infinite:
                return
            self._state.next_epoch()

    def _item(self, kind: str, indices: Optional[list]) -> tuple[dict, torch.Tensor]:
        if indices is None:  # a filler
            batch = filler_batch(self.collator)
        else:
            batch = self.collator([self.dataset[i] for i in indices])
            if batch["max_seqlen"] > self.seq_len:
                raise ValueError(
                    f"a piece of {batch['max_seqlen']} tokens (documents {list(indices)}) is longer than seq_len "
                    f"{self.seq_len}: torchtitan's RoPE holds seq_len positions; raise training.seq_len or use "
                    "overflow='split' with a smaller local_batch_size"
                )
        return to_torchtitan(batch, self.group, self.config.attention_masks)

    def state_dict(self) -> dict[str, Any]:
        """The resume state, the same on every rank (module docstring)."""
        return {"balancer": self._state.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from `state_dict()` (an empty dict: nothing to resume, as torchtitan's loaders accept)."""
        if not state_dict:
            return
        if "balancer" not in state_dict:
            raise ValueError(f"not a BalancedDataLoader state: keys {sorted(state_dict)}")
        self._state.load_state_dict(state_dict["balancer"])


def _check_seq_len(lengths, seq_len: int) -> None:
    """Refuse a document longer than `seq_len`: torchtitan's RoPE holds `training.seq_len` positions."""
    from balancer.training.lengths import scan_lengths

    summary = scan_lengths(lengths)
    if summary.longest > seq_len:
        raise ValueError(
            f"document {summary.longest_doc} has {summary.longest} tokens, more than seq_len {seq_len} (torchtitan's "
            "RoPE holds training.seq_len positions): raise training.seq_len (and lower local_batch_size to keep the "
            "memory), or pass overflow='split'"
        )


def _cp_group(topology: Topology, rank: int) -> Any:
    """This rank's CP process group (every rank creates every group, collectively); None without torch.distributed
    (a single process runs no CP)."""
    import dataclasses

    import torch.distributed as dist

    from balancer.training.groups import cp_groups

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("BalancedDataLoader with cp_degree > 1 needs torch.distributed initialised")
    if dist.get_world_size() != topology.dp * topology.cp or dist.get_rank() != rank:
        raise ValueError(
            f"cp_degree > 1 groups the trainer's batch ranks, which must be the torch.distributed ranks (no tensor or "
            f"pipeline parallelism beside it): world size {dist.get_world_size()}, rank {dist.get_rank()}, batch "
            f"ranks {topology.dp * topology.cp}, batch rank {rank}"
        )
    groups = cp_groups(dataclasses.replace(topology, pp=1))
    return groups[(rank // topology.cp * topology.cp, topology.cp)]
