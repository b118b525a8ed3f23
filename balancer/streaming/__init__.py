"""Streaming inputs: `BalancedStream`, balanced micro-batches from a stream of tokenized documents (a Hugging Face
streaming dataset, a pretokenized folder read as a stream, or any re-iterable iterable); docs/streaming.md.

One module per idea: sources.py (what each rank reads), windows.py (one window: read, gather, plan, exchange),
exchange.py (the collectives), state.py (resume states), dataset.py (the IterableDataset).
"""

from attention._lazy import lazy_exports

_EXPORTS = {"BalancedStream": "balancer.streaming.dataset"}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
