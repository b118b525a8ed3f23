"""balancer: sequence-length-aware packing and DP x CP x PP scheduling for mixed long/short training data."""
__version__ = "0.1.0"

from .cost import CostModel
from .topology import Topology
from .plan import Plan
from .planner import plan, pack_step
from .sampler import BalancedBatchSampler, Span, SpanDataset
from .collate import PackedCollator
from .dataset import ShardDataset, read_lengths
from . import loss

__all__ = ["CostModel", "Topology", "Plan", "plan", "pack_step", "BalancedBatchSampler", "PackedCollator",
           "Span", "SpanDataset", "ShardDataset", "read_lengths", "loss", "__version__"]
