"""Helpers for the pretokenize tests: small corpora and a real Hugging Face tokenizer trained locally."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

WORDS = (
    "the quick brown fox jumps over a lazy dog; héllo wörld ✓ naïve café 東京 😀 long context "
    "balancing attention tokens shard manifest"
).split()


def make_texts(n: int, seed: int = 0, max_words: int = 400) -> list[str]:
    """`n` documents of mixed lengths (a few long ones), with multi-byte UTF-8 characters and newlines."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = rng.choice([1, 3, 20, 80, max_words]) if i % 17 else max_words * 4
        words = [rng.choice(WORDS) for _ in range(k)]
        if i % 5 == 0:
            words.insert(k // 2, "\n")
        out.append(" ".join(words))
    return out


def write_jsonl(path: Path, texts: Sequence[str], field: str = "text") -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({field: t, "meta": i}, ensure_ascii=(i % 2 == 0)) + "\n")
    return path


def write_parquet(path: Path, texts: Sequence[str], field: str = "text", row_group_size: int = 7) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({field: list(texts), "n": list(range(len(texts)))}), path, row_group_size=row_group_size)
    return path


def train_hf_tokenizer(folder: Path, texts: Sequence[str], vocab_size: int = 300) -> Path:
    """Train a byte-level BPE with `tokenizers` and save it with transformers' save_pretrained into `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(folder))
    return folder


def dir_bytes(folder: Path) -> dict[str, bytes]:
    """{file name: bytes} of every file in `folder`."""
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir()) if p.is_file()}
