"""Data on disk, by product: `shards` (the pretokenized folder format that both products read and write: manifest,
open-time checks, `verify`, `ShardDataset`, the one lengths reader, output ownership), `pretokenize` (raw corpus ->
shards: readers, tokenizers, the local and Ray engines, `merge`), `pack` (`balancer pack`: balanced pre-packed
rows) and `traces` (built-in and published length traces). The two products' functions are reached through their
subpackages (`from balancer.data.pretokenize import pretokenize`, `from balancer.data.pack import pack`): the names
`balancer.data.pretokenize` and `balancer.data.pack` are the subpackages.
"""

from attention._lazy import lazy_exports

_EXPORTS = {
    "ShardDataset": "balancer.data.shards.dataset",
    "read_lengths": "balancer.data.shards.lengths",
    "verify": "balancer.data.shards.verify",
    "DataError": "balancer.data.shards.errors",
    "PretokenizeOptions": "balancer.data.pretokenize.options",
    "merge": "balancer.data.pretokenize.merge",
    "verify_packed": "balancer.data.pack.verify",
    "load_trace": "balancer.data.traces",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
