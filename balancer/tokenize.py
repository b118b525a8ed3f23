"""Tokenizers for `balancer pretokenize`: the built-in byte tokenizer and Hugging Face tokenizers.

Both expose the same small interface (:class:`Tokenizer`): a `name`, a stable content `hash` (recorded in the
manifest, part of the job identity used for resume), `vocab_size`, `eos_id`, the storage `dtype` and
`encode_batch(texts) -> (lengths, flat_ids)`, which encodes a batch without a Python loop per token.

Byte tokenizer (`--tokenizer byte`, the default): token ids are the UTF-8 bytes of the text (0..255); id 256 is
the end-of-document token appended by `--add-eos`. Its vocabulary size is 257 whether or not EOS is used, so a
model's embedding size does not depend on the flag. Ids are stored as uint16.

Hugging Face tokenizer: anything `transformers.AutoTokenizer.from_pretrained` loads (a local folder works
offline). Texts are encoded exactly as `tokenizer(text)["input_ids"]` does (the tokenizer's own special tokens,
e.g. BOS, included); `--add-eos` appends `tokenizer.eos_token_id`. Ids are stored as uint16 when the vocabulary
(`len(tokenizer)`) fits in 65,536 ids, else int32.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Optional, Sequence

import numpy as np

BYTE_VOCAB_SIZE = 257
BYTE_EOS_ID = 256


class TokenizerError(ValueError):
    """The tokenizer cannot be loaded or cannot be used with the requested options."""


class Tokenizer:
    """Interface shared by the byte and Hugging Face tokenizers."""

    name: str
    hash: str
    vocab_size: int
    eos_id: Optional[int]

    @property
    def dtype(self) -> np.dtype:
        """Storage dtype of token ids: uint16 when every id fits, else int32."""
        return np.dtype(np.uint16) if self.vocab_size <= 65536 else np.dtype(np.int32)

    def encode_batch(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Encode `texts`; returns (int64 lengths [n], flat ids [sum(lengths)] in `dtype`), ids of text j at
        flat[sum(lengths[:j]) : sum(lengths[:j+1])]. Raises UnicodeEncodeError/ValueError for an unencodable text."""
        raise NotImplementedError

    def describe(self) -> dict:
        """JSON-able description for the manifest."""
        return {"name": self.name, "hash": self.hash, "vocab_size": self.vocab_size, "eos_id": self.eos_id,
                "dtype": self.dtype.name}


class ByteTokenizer(Tokenizer):
    """ids = UTF-8 bytes of the text (0..255); EOS = 256; vocab_size = 257."""

    name = "byte"
    vocab_size = BYTE_VOCAB_SIZE
    eos_id = BYTE_EOS_ID

    def __init__(self) -> None:
        self.hash = hashlib.sha256(b"balancer-byte-tokenizer-v1:utf-8:eos=256").hexdigest()

    def encode_batch(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        encoded = [t.encode("utf-8") for t in texts]  # per document, C-level per byte
        lengths = np.fromiter((len(b) for b in encoded), dtype=np.int64, count=len(encoded))
        flat = np.frombuffer(b"".join(encoded), dtype=np.uint8).astype(np.uint16)
        return lengths, flat

    def decode(self, ids: np.ndarray) -> bytes:
        """The bytes of `ids` (EOS ids removed)."""
        ids = np.asarray(ids)
        return ids[ids != BYTE_EOS_ID].astype(np.uint8).tobytes()


class HFTokenizer(Tokenizer):
    """A `transformers.AutoTokenizer`, loaded from a local folder or a hub name (the latter needs the network)."""

    def __init__(self, name_or_path: str) -> None:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
        try:
            from transformers import AutoTokenizer
            self.tok = AutoTokenizer.from_pretrained(name_or_path)
        except Exception as exc:  # transformers raises OSError/ValueError/HTTP errors
            raise TokenizerError(f"cannot load tokenizer {name_or_path!r} with transformers.AutoTokenizer: "
                                 f"{type(exc).__name__}: {exc}") from exc
        self.name = name_or_path
        self.vocab_size = int(len(self.tok))
        self.eos_id = self.tok.eos_token_id
        self.hash = tokenizer_content_hash(self.tok)

    def encode_batch(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        ids = self.tok(list(texts), add_special_tokens=True, return_attention_mask=False,
                       return_token_type_ids=False, verbose=False)["input_ids"]
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        if len(ids) == 0:
            return lengths, np.zeros(0, self.dtype)
        flat = np.concatenate([np.asarray(x, dtype=self.dtype) for x in ids]) if lengths.sum() else \
            np.zeros(0, self.dtype)
        return lengths, flat


def tokenizer_content_hash(tok) -> str:
    """sha256 of what decides the ids: the tokenizer class, its fast-tokenizer JSON (normalizer, pre-tokenizer,
    model, post-processor, added tokens) or, for a slow tokenizer, its vocabulary, plus its special tokens. It does
    not depend on the folder the tokenizer was loaded from."""
    h = hashlib.sha256()
    h.update(type(tok).__name__.encode())
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode("utf-8"))
    else:
        h.update(json.dumps(sorted(tok.get_vocab().items()), ensure_ascii=False).encode("utf-8"))
    h.update(json.dumps(tok.special_tokens_map, sort_keys=True, default=str).encode("utf-8"))
    return h.hexdigest()


def load_tokenizer(spec: str) -> Tokenizer:
    """`"byte"` -> ByteTokenizer, anything else -> HFTokenizer(spec)."""
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)
