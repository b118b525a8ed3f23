"""TRL's ``DPOTrainer`` on balanced, packed micro-batches (``balancer.integrations.trl.BalancedDPOTrainer``).

Every optimizer step takes the next ``per_device_train_batch_size x gradient_accumulation_steps x processes``
pairs of the epoch's seeded order (the stock step's size), plans them with ``balance_batch(lengths of the 2P
sequences, dp = processes, micro_batches = gradient_accumulation_steps, groups = pair, keep="micro_batch")`` (the
same plan on every rank; both sequences of a pair in one micro-batch), and packs each micro-batch padding-free.
A last step too small to give every micro-batch a pair joins the step before it (nothing is dropped).

The loss of a micro-batch is the sum of its pairs' losses over the step's global pair count (times the process
count: DDP averages): summed over micro-batches and ranks it is the mean pair loss of the step, the stock value when
the stock micro-batches hold equal pair counts. That holds for the per-pair loss types (``PAIR_LOSSES``); ``aot``
and ``aot_unpaired`` sort margins across a micro-batch and ``sft`` averages tokens over it, so their value depends
on which pairs share a micro-batch: refused, as are ``ld_alpha``, ``use_weighting`` (WPO), other
``f_divergence_type``s, MoE auxiliary losses and evaluation.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F

try:
    from trl import DPOConfig, DPOTrainer
except ImportError as exc:  # pragma: no cover - exercised without trl only
    raise ImportError("balancer.integrations.trl needs TRL: pip install 'seqbalancer[trainer]'") from exc

from balancer.integrations.packed import completion_logps, pack_sequences, project_attention, world
from balancer.planning.batch.balance import balance_batch
from balancer.planning.cost.model import CostModel
from balancer.planning.topology import Topology
from balancer.trainers.loss_log import process_mean
from balancer.training.plan_batches import plan_micro_batches

logger = logging.getLogger(__name__)

PAIR_LOSSES = ("sigmoid", "hinge", "ipo", "robust", "bco_pair", "sppo_hard", "nca_pair", "apo_zero", "apo_down")


def pair_loss(
    kind: str,
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    c_len: torch.Tensor,
    r_len: torch.Tensor,
    beta: float,
    smoothing: float,
) -> torch.Tensor:
    """TRL 1.16's per-pair DPO loss `kind` (reverse-KL scores) from summed sequence log-probabilities."""
    cr, rr = chosen - ref_chosen, rejected - ref_rejected
    delta = cr - rr
    if kind == "sigmoid":
        return -F.logsigmoid(beta * delta)
    if kind == "hinge":
        return torch.relu(1 - beta * delta)
    if kind == "ipo":
        return (cr / c_len.clamp(min=1) - rr / r_len.clamp(min=1) - 1 / (2 * beta)) ** 2
    if kind == "robust":
        clean = -(1 - smoothing) * F.logsigmoid(beta * delta)
        return (clean + smoothing * F.logsigmoid(-beta * delta)) / (1 - 2 * smoothing)
    if kind == "bco_pair":
        return -F.logsigmoid(beta * cr) - F.logsigmoid(-beta * rr)
    if kind == "sppo_hard":
        return (cr - 0.5 / beta) ** 2 + (rr + 0.5 / beta) ** 2
    if kind == "nca_pair":
        return -F.logsigmoid(beta * cr) - 0.5 * F.logsigmoid(-beta * cr) - 0.5 * F.logsigmoid(-beta * rr)
    if kind == "apo_zero":
        return 1 - torch.sigmoid(beta * cr) + torch.sigmoid(beta * rr)
    if kind == "apo_down":
        return torch.sigmoid(beta * cr) + 1 - torch.sigmoid(beta * (cr - rr))
    raise ValueError(f"loss_type {kind!r} is not one of the per-pair losses {PAIR_LOSSES}")


class PairBatchSampler:
    """This rank's micro-batches of pair-sequence ids (`2 * pair + side`, side 0 chosen, 1 rejected), step by step;
    every iteration is the next epoch (seeded order `seed + epoch`)."""

    def __init__(
        self, lengths: np.ndarray, topology: Topology, cost: CostModel, rank: int, seed: int, pairs_per_step: int
    ) -> None:
        self.lengths, self.topology, self.cost = lengths, topology, cost  # lengths [n_pairs, 2]
        self.rank, self.seed, self.epoch = rank, seed, 0
        self.pairs_per_step = pairs_per_step
        n, least = len(lengths), topology.dp * topology.micro_batches
        if n < least:
            raise ValueError(
                f"train_dataset has {n} pairs, fewer than processes * gradient_accumulation_steps = {least}: every "
                "micro-batch of a step needs a pair"
            )
        full, rest = divmod(n, pairs_per_step)
        self.num_steps = full + (1 if rest >= least else 0) or 1  # a remainder too small for a step joins the last

    def __len__(self) -> int:
        return self.num_steps * self.topology.micro_batches

    def steps(self, epoch: int) -> list[np.ndarray]:
        order = np.random.default_rng(self.seed + epoch).permutation(len(self.lengths))
        cuts = [min(i * self.pairs_per_step, len(order)) for i in range(self.num_steps)] + [len(order)]
        return [order[a:b] for a, b in zip(cuts[:-1], cuts[1:])]

    def __iter__(self):
        epoch, self.epoch = self.epoch, self.epoch + 1
        for pairs in self.steps(epoch):
            lengths = self.lengths[pairs].reshape(-1)
            plan = balance_batch(
                lengths, self.topology, self.cost, groups=np.repeat(np.arange(len(pairs)), 2), keep="micro_batch"
            )
            for mb in plan_micro_batches(plan, self.rank):
                yield [(int(pairs[int(j) // 2]), int(j) % 2, len(pairs)) for j in mb]


def collate_pairs(rows: list[dict]) -> dict:
    """A packed micro-batch of pair sequences, plus per sequence its pair, side and reference log-probability."""
    batch = pack_sequences([r["prompt_ids"] for r in rows], [r["completion_ids"] for r in rows])
    batch["pair"] = torch.tensor([r["pair"] for r in rows])
    batch["side"] = torch.tensor([r["side"] for r in rows])
    batch["num_pairs"] = rows[0]["num_pairs"]
    if all(r.get("ref_logps") is not None for r in rows):
        batch["ref_logps"] = torch.tensor([r["ref_logps"] for r in rows], dtype=torch.float64)
    return batch


class _PairSequences(torch.utils.data.Dataset):
    """Index `(pair, side, num_pairs)` -> one sequence of a tokenized preference pair."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        pair, side, num_pairs = index
        row = self.dataset[pair]
        key = "chosen" if side == 0 else "rejected"
        return {
            "prompt_ids": row["prompt_ids"],
            "completion_ids": row[f"{key}_ids"],
            "pair": pair,
            "side": side,
            "num_pairs": num_pairs,
            "ref_logps": row.get(f"ref_{key}_logps"),
        }


def check_dpo_args(args: DPOConfig, trainer: DPOTrainer) -> None:
    """Refuse the DPO settings whose loss depends on micro-batch membership or that this path does not implement."""
    bad = [t for t in args.loss_type if t not in PAIR_LOSSES]
    if bad:
        raise ValueError(
            f"DPOConfig(loss_type={bad}): balanced micro-batches take the per-pair losses {PAIR_LOSSES}; 'aot', "
            "'aot_unpaired' and 'sft' depend on which pairs share a micro-batch"
        )
    problems = {
        "ld_alpha": args.ld_alpha is not None,
        "use_weighting": bool(args.use_weighting),
        "f_divergence_type": args.f_divergence_type != "reverse_kl",
        "eval_strategy": str(args.eval_strategy) not in ("no", "IntervalStrategy.NO"),
        "router_aux_loss_coef (MoE)": bool(getattr(trainer, "aux_loss_enabled", False)),
    }
    named = [k for k, v in problems.items() if v]
    if named:
        raise ValueError(f"BalancedDPOTrainer does not support {', '.join(named)} (see docs/post-training.md)")


def _pair_lengths(dataset, max_length: Optional[int]) -> np.ndarray:
    rows = [(len(r["prompt_ids"]), len(r["chosen_ids"]), len(r["rejected_ids"])) for r in dataset]
    out = np.array([[p + c, p + r] for p, c, r in rows], dtype=np.int64).reshape(-1, 2)
    if max_length is not None and len(out) and out.max() > max_length:
        i = int(np.argmax(out.max(axis=1)))
        raise ValueError(
            f"train_dataset pair {i} has a {int(out[i].max())}-token sequence, more than DPOConfig.max_length="
            f"{max_length}: balanced micro-batches never truncate; set max_length=None or filter the data"
        )
    return out


def dpo_topology(args: DPOConfig, lengths: np.ndarray, processes: int) -> Topology:
    """dp = processes, micro_batches = gradient accumulation; a micro-batch holds up to the stock padded batch's
    tokens (`per_device_train_batch_size` pairs of 2 sequences of the longest length)."""
    b = max(1, int(args.per_device_train_batch_size))
    max_tokens = 2 * b * int(lengths.max())
    m = max(1, int(args.gradient_accumulation_steps))
    return Topology(dp=processes, cp=1, micro_batches=m, max_tokens=max_tokens, tokens_per_step=None)


class BalancedDPOTrainer(DPOTrainer):
    """``trl.DPOTrainer`` on balanced, packed micro-batches (module docstring). Extra keyword arguments: ``cost``
    (default ``CostModel.from_config(model.config)``) and ``seed`` (the pair order; default ``args.seed``)."""

    loss_is_scaled_for_ga = True
    args: DPOConfig  # what DPOTrainer is given

    def __init__(self, *args, cost: Optional[CostModel] = None, seed: Optional[int] = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        check_dpo_args(self.args, self)
        rank, processes = world()
        lengths = _pair_lengths(self.train_dataset, self.args.max_length)
        topology = dpo_topology(self.args, lengths, processes)
        model: Any = self.model  # a transformers model or a PEFT wrapper of one: both have .config
        cost = cost or CostModel.from_config(model.config.to_dict())
        seed = self.args.seed if seed is None else seed
        per_step = self.args.per_device_train_batch_size * topology.micro_batches * processes  # the stock step
        self.pair_sampler = PairBatchSampler(lengths, topology, cost, rank, seed, per_step)
        logger.info("balanced DPO: %s, %d pairs per step", topology, self.pair_sampler.pairs_per_step)

    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(
            _PairSequences(self.train_dataset), batch_sampler=self.pair_sampler, collate_fn=collate_pairs
        )

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        import attention.hf as ahf

        # attention and layout held through backward: activation checkpointing recomputes the forward there
        with project_attention(self.model, self.ref_model), ahf.cp_context(inputs["layout"]):
            return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        if return_outputs:
            raise ValueError("BalancedDPOTrainer does not return outputs (no evaluation or compute_metrics)")
        logps = _sequence_logps(model, inputs)
        if "ref_logps" in inputs:
            ref = inputs["ref_logps"].to(logps)
        else:
            with torch.no_grad():
                ref = _sequence_logps(self.ref_model if self.ref_model is not None else model, inputs)
        side, pair = inputs["side"], inputs["pair"]
        ch, rj = torch.where(side == 0)[0], torch.where(side == 1)[0]
        ch, rj = ch[torch.argsort(pair[ch])], rj[torch.argsort(pair[rj])]
        lens = inputs["seq_loss_tokens"].to(logps)
        total: torch.Tensor | float = 0.0
        weights = self.loss_weights or [1.0] * len(self.loss_types)
        for kind, w in zip(self.loss_types, weights):
            per_pair = pair_loss(
                kind, logps[ch], logps[rj], ref[ch], ref[rj], lens[ch], lens[rj], self.beta, self.label_smoothing
            )
            total = total + w * per_pair.sum()
        self._record(logps[ch] - ref[ch], logps[rj] - ref[rj])
        return total / inputs["num_pairs"] * self.accelerator.num_processes

    def _record(self, chosen_ratio, rejected_ratio) -> None:
        chosen, rejected = self.beta * chosen_ratio.detach(), self.beta * rejected_ratio.detach()
        metrics = self._metrics["train"]
        metrics["rewards/margins"].append(float((chosen - rejected).mean()))
        metrics["rewards/accuracies"].append(float((chosen > rejected).float().mean()))

    def _finalize_training(self, trial, num_train_samples, start_time):
        self._tr_loss = process_mean(self._tr_loss)  # see BalancedTrainer: every rank holds a share
        return super()._finalize_training(trial, num_train_samples, start_time)


def _sequence_logps(model, batch: dict) -> torch.Tensor:
    """Summed completion log-probability of every sequence of the micro-batch ([n_seq], float64)."""
    from balancer.integrations.packed import loss_token_seq

    tok = completion_logps(model, batch)
    seq = loss_token_seq(batch).to(tok.device)
    out = torch.zeros(len(batch["side"]), dtype=torch.float64, device=tok.device)
    return out.index_add(0, seq, tok.double())
