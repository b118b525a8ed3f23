"""Token ids beyond the storage dtype: a real Hugging Face tokenizer whose ids have holes (3 tokens, the largest
id 70,000) is stored as int32, every id exact; before, its `len()` of 3 chose uint16 and the id 70,000 could not be
stored (an OverflowError traceback, or ids wrapped modulo 65,536)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from balancer.cli import main


@pytest.fixture(scope="module")
def sparse_tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tok_sparse")
    core = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 70_000}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]").save_pretrained(folder)
    return folder


def test_ids_beyond_uint16_are_stored_exactly(sparse_tokenizer, tmp_path):
    from balancer import ShardDataset

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["a b a", "b b", "c a"]))
    out = tmp_path / "tok"
    argv = ["pretokenize", str(src), "--output", str(out), "--tokenizer", str(sparse_tokenizer)]
    assert main(argv) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tokenizer"]["vocab_size"] == 70_001 and manifest["tokenizer"]["dtype"] == "int32"
    ds = ShardDataset(out)
    assert [np.asarray(ds.token_ids(i)).tolist() for i in range(len(ds))] == [[1, 70_000, 1], [70_000, 70_000], [0, 1]]
    assert main(["verify", str(out)]) == 0
