"""torchft (PyTorch's fault-tolerant training) on balanced micro-batches: `FaultTolerantBatches` plans every step
over the replica groups that contribute to it, keeps the failure-free run's steps (every document of an epoch
exactly once in the committed steps, through failures and rejoins) and measures each group's speed by its
`replica_id`. See docs/fault-tolerance.md.

- ``batches``: `FaultTolerantBatches`, the data layer a torchft training loop calls per step;
- ``exchange``: the one small allreduce that tells every group who contributes;
- ``step_plan``: a failure-free step planned over the contributing groups;
- ``speeds``: `ReplicaSpeeds`, measured speeds, slowdowns and stalls per `replica_id`.

Importing this package does not import torchft: the loop passes its `Manager`.
"""

from balancer.integrations.torchft.batches import FaultTolerantBatches
from balancer.integrations.torchft.speeds import ReplicaSpeeds
from balancer.integrations.torchft.step_plan import StepPieces, StepPlan, plan_step

__all__ = ["FaultTolerantBatches", "ReplicaSpeeds", "StepPieces", "StepPlan", "plan_step"]
