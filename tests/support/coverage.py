"""The multiset of (document, token) pairs that sampler indices cover: exactly-once checks compare it."""

from __future__ import annotations

from collections import Counter

from balancer.training.indices import Span


def covered_tokens(items, lengths) -> Counter:
    """(doc, token) pairs covered by the yielded indices: a Span covers its window, a plain id its whole document."""
    c = Counter()
    for i in items:
        if isinstance(i, Span):
            c.update((i.doc, t) for t in range(i.start, i.end))
        else:
            c.update((int(i), t) for t in range(int(lengths[i])))
    return c
