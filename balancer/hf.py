"""Hugging Face training in one line: ``balancer.hf.BalancedTrainer`` (a ``transformers.Trainer``) and
``balancer.hf.BalancedSFTTrainer`` (TRL's ``SFTTrainer``) on balanced, packed, context-parallel data.

Import it explicitly (``import balancer.hf``): ``import balancer`` does not import transformers or TRL. See
docs/training.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from balancer.trainers.trainer import SAMPLER_STATE_NAME, BalancedTrainer, BalancedTrainingMixin

if TYPE_CHECKING:
    from balancer.trainers.sft import BalancedSFTTrainer

__all__ = ["BalancedTrainer", "BalancedSFTTrainer", "BalancedTrainingMixin", "SAMPLER_STATE_NAME"]


def __getattr__(name: str):
    if name == "BalancedSFTTrainer":  # TRL is imported only when the SFT trainer is asked for
        from balancer.trainers.sft import BalancedSFTTrainer

        return BalancedSFTTrainer
    raise AttributeError(f"module 'balancer.hf' has no attribute {name!r}")
