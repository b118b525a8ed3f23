"""Fixtures shared by the data tests: one small JSONL corpus (`src`) and its byte-tokenized folder (`ref`), built
once per test module (module scope: a test that changes them must work on a copy)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.reliability import make_corpus, tokenize


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    """A JSONL corpus of 120 texts (`support.reliability.make_corpus`)."""
    return make_corpus(tmp_path_factory.mktemp("src"))


@pytest.fixture(scope="module")
def ref(tmp_path_factory, src) -> Path:
    """`src` pretokenized with the byte tokenizer into several shards, uninterrupted: the bytes a resumed run must
    end with."""
    out = tmp_path_factory.mktemp("ref") / "tok"
    tokenize([src], out)
    return out
