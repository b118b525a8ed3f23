"""`balancer pretokenize`: a raw corpus (.jsonl/.json/.txt, .gz/.zst, parquet, HF datasets) to shards.

Modules: compression.py and readers.py (inputs, fingerprints, resumable record stream), tokenize.py (byte and
Hugging Face tokenizers), pipeline.py (the local engine: `pretokenize`), ray_engine.py (`--engine ray`),
merge.py (`merge`: join slices pretokenized on several machines).
"""

from attention._lazy import lazy_exports

_EXPORTS = {
    "pretokenize": "balancer.data.pretokenize.pipeline",
    "PretokenizeOptions": "balancer.data.pretokenize.options",
    "merge": "balancer.data.pretokenize.merge",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
