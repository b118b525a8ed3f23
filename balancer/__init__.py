"""balancer: sequence-length-aware packing and DP x CP x PP scheduling for mixed long/short training data.

Sub-packages by concern: ``balancer.planning`` (cost model, topology, plan, planner, metrics),
``balancer.training`` (sampler, collator, loss), ``balancer.data`` (readers, tokenizers, shards, traces) and
``balancer.cli`` (the ``balancer`` command, thin over the rest). See docs/design.md.
"""

__version__ = "0.1.0"

from . import _compat
from .data.dataset import ShardDataset, read_lengths
from .planning.cost import CostModel
from .planning.plan import Plan
from .planning.planner import pack_step, plan
from .planning.topology import Topology
from .training import loss
from .training.collate import PackedCollator
from .training.groups import cp_groups
from .training.indices import CPGroup, Member
from .training.sampler import BalancedBatchSampler, Span, SpanDataset

_compat.install_aliases()

__all__ = [
    "CostModel",
    "Topology",
    "Plan",
    "plan",
    "pack_step",
    "BalancedBatchSampler",
    "PackedCollator",
    "Span",
    "SpanDataset",
    "Member",
    "CPGroup",
    "cp_groups",
    "ShardDataset",
    "read_lengths",
    "loss",
    "__version__",
]
