"""Evaluation for the balanced Trainers: packed, balanced eval batches and a token-weighted eval loss.

The eval set is one fixed batch: `balance_batch(eval lengths, the run's topology with the fewest micro-batches that
fit, micro_batches="auto")` spreads its documents over every DP rank (CP groups as in training) so that each rank
does the same work, packs them into micro-batches within the training budget (`max_tokens * cp` tokens), and
every document is evaluated exactly once. The reported `eval_loss` is the token-weighted mean over the whole eval
set, `sum of every loss token's cross-entropy / number of loss tokens` (summed over all ranks in float64), and
`eval_loss_tokens` is that count. (The stock Trainer's `eval_loss` is a mean of per-batch means weighted by
batch size, a different figure unless all batches hold the same number of loss tokens.) `compute_metrics` and
`predict` are refused: packed, CP-sharded batches have no per-example predictions to hand to them.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist

from balancer.planning.batch.balance import balance_batch
from balancer.trainers.host import TrainerHost
from balancer.training.indices import SpanDataset
from balancer.training.lengths import resolve_lengths
from balancer.training.loss import token_loss
from balancer.training.plan_batches import plan_micro_batches

if TYPE_CHECKING:
    from transformers.trainer_utils import EvalLoopOutput

logger = logging.getLogger(__name__)


def eval_lengths(dataset: Any) -> np.ndarray:
    """Token count of every eval row: from a `datasets.Dataset`'s `input_ids` or a `ShardDataset`'s lengths, else by
    reading each row's `input_ids`."""
    try:
        return np.asarray(resolve_lengths(dataset, dataset)[0])
    except (ValueError, TypeError):
        return np.array([len(dataset[i]["input_ids"]) for i in range(len(dataset))], dtype=np.int64)


class BalancedEvalMixin(TrainerHost):
    """`get_eval_dataloader` and `evaluation_loop` of the balanced Trainers (see the module docstring)."""

    def _eval_batches(self, dataset) -> list[list]:
        """This rank's eval micro-batches of `dataset` (planned once per dataset object, the same on every rank)."""
        cache = self.__dict__.setdefault("_eval_plans", {})
        key = id(dataset)
        if key not in cache:
            lengths = eval_lengths(dataset)
            if len(lengths) == 0:
                raise ValueError("the eval dataset is empty")
            t = self.topology
            fewest = max(1, math.ceil(int(lengths.sum()) / (t.pool_size * t.max_tokens)))
            topo = replace(t, micro_batches=fewest, tokens_per_step=None)
            try:
                plan = balance_batch(
                    lengths, topo, self.cost_model, micro_batches="auto", overflow=self._overflow, seed=self._plan_seed
                )
            except ValueError as e:
                raise ValueError(f"eval_dataset: {e}") from None
            batches = plan_micro_batches(plan, self.dp_rank * t.cp + self.cp_rank)
            logger.info(
                "eval: %d documents (%d tokens) in %d balanced micro-batches per rank",
                len(lengths),
                int(lengths.sum()),
                len(batches),
            )
            cache[key] = (dataset, batches)  # the dataset is held so its id is not reused
        return cache[key][1]

    def get_eval_dataloader(self, eval_dataset: Any = None) -> torch.utils.data.DataLoader:
        """This rank's packed, balanced eval micro-batches of `eval_dataset` (a dataset, the name of one of a dict
        `eval_dataset`, or None: the trainer's)."""
        if isinstance(eval_dataset, str):
            named = self.eval_dataset
            if not isinstance(named, dict) or eval_dataset not in named:
                raise ValueError(f"eval_dataset={eval_dataset!r} names no dataset of the trainer's eval_dataset dict")
            dataset = named[eval_dataset]
        else:
            dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluation needs an eval_dataset")
        if isinstance(dataset, dict):
            raise ValueError("a dict of eval datasets is evaluated one by one: call evaluate() without eval_dataset")
        a = self.args
        return torch.utils.data.DataLoader(
            SpanDataset(dataset),
            batch_sampler=self._eval_batches(dataset),
            collate_fn=self.packed_collator,
            num_workers=a.dataloader_num_workers,
            pin_memory=a.dataloader_pin_memory,
        )

    def evaluation_loop(
        self,
        dataloader: torch.utils.data.DataLoader,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> EvalLoopOutput:
        """Forward passes over this rank's eval micro-batches; the token-weighted loss over all ranks."""
        from transformers.trainer_utils import EvalLoopOutput

        model = self.model
        assert model is not None, "a Trainer holds its model"
        model.eval()
        optimizer_eval = getattr(self.optimizer, "eval", None)  # schedule-free optimizers: their eval weights
        if callable(optimizer_eval):
            optimizer_eval()
        self.callback_handler.eval_dataloader = dataloader
        device = self.args.device
        sums = torch.zeros(2, dtype=torch.float64)  # summed cross-entropy, loss tokens
        with torch.no_grad():
            for inputs in dataloader:
                with self._layout_context(model, inputs), self.compute_loss_context_manager():
                    out = model(
                        input_ids=inputs["input_ids"].to(device),
                        position_ids=inputs["position_ids"].to(device),
                        use_cache=False,
                    )
                    ce = token_loss(out.logits, inputs["labels"].to(device), reduction="sum")
                sums[0] += float(ce.double())
                if inputs["cp_rank"] == 0:  # the collator counts a micro-batch over its whole CP group
                    sums[1] += int(inputs["num_loss_tokens"])
                self.control = self.callback_handler.on_prediction_step(self.args, self.state, self.control)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            on = torch.device("cpu") if dist.get_backend() == "gloo" else device
            reduced = sums.to(on)
            dist.all_reduce(reduced)
            sums = reduced.cpu()
        count = int(sums[1])
        loss = float(sums[0] / count) if count else float("nan")
        metrics = {f"{metric_key_prefix}_loss": loss, f"{metric_key_prefix}_loss_tokens": count}
        dataset = getattr(dataloader, "dataset", None)
        return EvalLoopOutput(
            predictions=None,  # type: ignore[arg-type]  # none gathered (the stock loop passes None too)
            label_ids=None,
            metrics=metrics,
            num_samples=len(dataset) if dataset else 0,
        )

    def predict(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            "predict() on balanced packed batches has no per-example outputs: use evaluate() for the loss, or a plain "
            "Trainer on the saved model for predictions"
        )
