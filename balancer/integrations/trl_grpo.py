"""TRL's ``GRPOTrainer`` on balanced, packed micro-batches (``BalancedGRPOTrainer``).

TRL generates and scores a generation batch (this rank's ``per_device_train_batch_size x steps_per_generation``
rows: prompts, completions, advantages, reference / old log-probabilities) exactly as the stock trainer does.
Instead of shuffling it into equal-sized slices, ``balance_batch(prompt + completion lengths, micro_batches =
steps_per_generation)`` spreads the rows over this rank's micro-batches by attention + linear work, and each
micro-batch is one packed, padding-free sequence run through the project's attention (TRL's fused LM head gives
the log-probabilities, temperature included). Each rank balances its own rollouts (they are not moved between
ranks), every rank runs the same number of micro-batches, CP is off.

The loss of a micro-batch is its tokens' per-token loss (TRL's formulas) weighted by the step's global counts, so
that the sum over micro-batches and ranks is the stock step loss whatever the micro-batch membership:
``grpo`` / ``sapo``: 1 / (S * completion length) (S = the step's sequences over all ranks); ``dr_grpo``:
1 / (S * max_completion_length); ``luspo``: 1 / S; ``dapo`` / ``cispo``: 1 / N (N = the step's completion tokens).
These equal the stock values because the stock slices all hold ``per_device_train_batch_size`` rows. ``bnpo`` (a
token mean per micro-batch) depends on membership: it is computed as the step's token mean (as ``dapo``) and
differs from the stock value. Refused: vLLM, ``vespo``, entropy masks and bonuses, off-policy masks, tools,
multimodal inputs, MoE auxiliary losses, ``steps_per_generation != gradient_accumulation_steps`` and evaluation.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import numpy as np
import torch

try:
    from trl import GRPOConfig, GRPOTrainer
except ImportError as exc:  # pragma: no cover - exercised without trl only
    raise ImportError("balancer.integrations.trl_grpo needs TRL: pip install 'seqbalancer[trainer]'") from exc

from balancer.integrations.packed import (
    completion_logps,
    global_sum,
    loss_token_seq,
    pack_sequences,
    project_attention,
)
from balancer.planning.batch.balance import balance_batch
from balancer.planning.cost.model import CostModel
from balancer.planning.topology import Topology
from balancer.trainers.loss_log import process_mean
from balancer.training.plan_batches import plan_micro_batches

logger = logging.getLogger(__name__)

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "luspo", "cispo", "sapo")
MEMBERSHIP_FREE = ("grpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo")  # equal to the stock loss


def check_grpo(trainer: BalancedGRPOTrainer) -> None:
    """Refuse what the packed path does not reproduce, naming the option."""
    a = trainer.args
    if a.loss_type not in LOSS_TYPES:
        raise ValueError(f"GRPOConfig(loss_type={a.loss_type!r}): BalancedGRPOTrainer takes {LOSS_TYPES}")
    problems = {
        "use_vllm": trainer.use_vllm,
        "top_entropy_quantile < 1": trainer.top_entropy_quantile < 1.0,
        "off_policy_mask_threshold": trainer.off_policy_mask_threshold is not None,
        "an entropy bonus": bool(getattr(trainer, "_entropy_bonus_enabled", False)),
        "tools / environments": bool(trainer.tools) or trainer.environment_factories is not None,
        "router_aux_loss_coef (MoE)": bool(trainer.aux_loss_enabled),
        "steps_per_generation != gradient_accumulation_steps": a.steps_per_generation != a.gradient_accumulation_steps,
        "eval_strategy": str(a.eval_strategy) not in ("no", "IntervalStrategy.NO"),
    }
    named = [k for k, v in problems.items() if v]
    if named:
        raise ValueError(f"BalancedGRPOTrainer does not support {', '.join(named)} (see docs/post-training.md)")


def split_generation(out: dict, micro_batches: int, cost: CostModel, seed: int) -> list[dict]:
    """The generation batch `out` (TRL's padded tensors) as `micro_batches` balanced, packed micro-batches, each
    with its rows' per-token advantages, reference / old log-probabilities (aligned with its loss tokens) and the
    step's global sequence and token counts."""
    if any(k in out for k in ("pixel_values", "tool_mask", "importance_sampling_ratio")):
        raise ValueError("BalancedGRPOTrainer takes text-only rollouts without tools or vLLM sampling corrections")
    pmask, cmask = out["prompt_mask"].bool(), out["completion_mask"].bool()
    p_len, c_len = pmask.sum(1), cmask.sum(1)
    if not torch.equal(cmask, torch.arange(cmask.shape[1], device=cmask.device)[None] < c_len[:, None]):
        raise ValueError("completion_mask is not a prefix mask: the packed path needs each completion's tokens first")
    lengths = (p_len + c_len).cpu().numpy().astype(np.int64)
    rows = len(lengths)
    s_global, n_global = global_sum([rows, float(c_len.sum())])
    topo = Topology(dp=1, cp=1, micro_batches=micro_batches, max_tokens=int(lengths.sum()), tokens_per_step=None)
    plan = balance_batch(lengths, topo, cost, seed=seed)
    batches = []
    for mb in plan_micro_batches(plan, 0):
        idx = [int(i) for i in mb]
        batch = pack_sequences(
            [out["prompt_ids"][i][pmask[i]].cpu() for i in idx],
            [out["completion_ids"][i][: c_len[i]].cpu() for i in idx],
        )
        c = c_len[idx].cpu()
        batch["seq_completion"] = c
        batch["seq_advantage"] = out["advantages"][idx].reshape(len(idx), -1).cpu()
        for key in ("old_per_token_logps", "ref_per_token_logps"):
            if out.get(key) is not None:
                batch[key] = torch.cat([out[key][i][: c_len[i]].cpu() for i in idx])
        batch.update(num_sequences=s_global, num_loss_tokens_global=n_global)
        batches.append(batch)
    return batches


def _token_advantages(batch: dict, seq: torch.Tensor) -> torch.Tensor:
    adv = batch["seq_advantage"].to(seq.device)
    if adv.shape[1] == 1:
        return adv[seq, 0]
    raise ValueError("BalancedGRPOTrainer takes one advantage per sequence (TRL's default), got per-token advantages")


class BalancedGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` on balanced, packed micro-batches (module docstring). Extra keyword argument: ``cost``
    (default ``CostModel.from_config(model.config)``)."""

    args: GRPOConfig  # what GRPOTrainer is given

    def __init__(self, *args, cost: Optional[CostModel] = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        check_grpo(self)
        model: Any = self.model  # a transformers model or a PEFT wrapper of one: both have .config
        self.balance_cost = cost or CostModel.from_config(model.config.to_dict())
        self._balanced_inputs: Optional[list[dict]] = None  # the packed micro-batches of the last generation
        if self.loss_type not in MEMBERSHIP_FREE:
            logger.warning(
                "loss_type=%r is a token mean per stock micro-batch: balanced micro-batches compute the step's token "
                "mean instead (as 'dapo'), which differs from the stock value",
                self.loss_type,
            )

    def _prepare_inputs(self, generation_batch):
        assert self.model is not None, "a Trainer holds its model"
        if not self.model.training:
            raise ValueError("BalancedGRPOTrainer does not evaluate: set eval_strategy='no'")
        per_generation = self.args.steps_per_generation
        assert per_generation is not None, "GRPOConfig fills steps_per_generation in"
        generate_every = per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._balanced_inputs is None:
            out = self._generate_and_score_completions(generation_batch)
            self._balanced_inputs = split_generation(
                out, per_generation, self.balance_cost, self.args.seed + self._step
            )
        return self._balanced_inputs[self._step % per_generation]

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """Forward + backward of one packed micro-batch inside the project's attention (held through backward:
        activation checkpointing recomputes the forward there); the model's own attention is back for generation."""
        import attention.hf as ahf

        model.train()
        batch = self._prepare_inputs(inputs)
        with project_attention(self.model, self.ref_model), ahf.cp_context(batch["layout"]):
            loss = self._packed_loss(model, batch)
            self.accelerator.backward(loss)
        self._step += 1
        return loss.detach()

    def _packed_loss(self, model, batch: dict) -> torch.Tensor:
        logp = completion_logps(model, batch)
        seq = loss_token_seq(batch).to(logp.device)
        old = batch.get("old_per_token_logps")
        old = logp.detach() if old is None else old.to(logp)
        log_ratio = logp - old
        c = batch["seq_completion"].to(logp)
        if self.importance_sampling_level == "sequence":
            seq_ratio = torch.zeros(len(c), dtype=logp.dtype, device=logp.device).index_add(0, seq, log_ratio)
            log_ratio = (seq_ratio / c.clamp(min=1))[seq]
        coef_1 = torch.exp(log_ratio)
        adv = _token_advantages(batch, seq).to(logp)
        per_token = self._per_token_loss(coef_1, adv, logp)
        if self.beta != 0.0:
            ref = batch["ref_per_token_logps"].to(logp)
            kl = torch.exp(ref - logp) - (ref - logp) - 1
            if self.args.use_bias_correction_kl:
                kl = kl * coef_1
            per_token = per_token + self.beta * kl
        return (per_token * self._token_weights(batch, seq, c)).sum() * self.accelerator.num_processes

    def _per_token_loss(self, coef_1, adv, logp) -> torch.Tensor:
        if self.loss_type == "cispo":
            return -torch.clamp(coef_1, max=self.epsilon_high).detach() * adv * logp
        if self.loss_type == "sapo":
            temp = torch.where(adv > 0, self.args.sapo_temperature_pos, self.args.sapo_temperature_neg)
            return -torch.sigmoid(temp * (coef_1 - 1)) * 4 / temp * adv
        coef_2 = torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)
        if self.args.delta is not None:
            coef_1 = torch.clamp(coef_1, max=self.args.delta)
        return -torch.min(coef_1 * adv, coef_2 * adv)

    def _token_weights(self, batch: dict, seq: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        s, n = batch["num_sequences"], max(batch["num_loss_tokens_global"], 1.0)
        if self.loss_type in ("grpo", "sapo"):
            return 1.0 / (s * c.clamp(min=1)[seq])
        if self.loss_type == "dr_grpo":
            return torch.full_like(seq, 1.0 / (s * self.max_completion_length), dtype=c.dtype)
        if self.loss_type == "luspo":
            return torch.full_like(seq, 1.0 / s, dtype=c.dtype)
        return torch.full_like(seq, 1.0 / n, dtype=c.dtype)  # dapo, cispo, bnpo: the step's token mean

    def _finalize_training(self, trial, num_train_samples, start_time):
        self._tr_loss = process_mean(self._tr_loss)  # see BalancedTrainer: every rank holds a share
        return super()._finalize_training(trial, num_train_samples, start_time)
