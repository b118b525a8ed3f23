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
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

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
        return {
            "name": self.name,
            "hash": self.hash,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "dtype": self.dtype.name,
        }


def _unreadable_json_in(folder: str) -> Optional[str]:
    """'FILE: why' for the first JSON file of a tokenizer folder that is not UTF-8 JSON (None: all read)."""
    from balancer.strict_json import JSONFileError, parse_json

    if not os.path.isdir(folder):
        return None
    for name in sorted(os.listdir(folder)):
        if name.endswith(".json"):
            try:
                with open(os.path.join(folder, name), "rb") as f:
                    parse_json(f.read(), os.path.join(folder, name))
            except (JSONFileError, OSError) as exc:
                return f"cannot load tokenizer {folder!r}: {exc}"
    return None


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
        except ImportError:
            raise TokenizerError(
                f"tokenizer {name_or_path!r} needs transformers: pip install 'seqbalancer[hf]'"
            ) from None
        missing = _missing_folder(name_or_path)
        if missing and _path_like(name_or_path):  # never a hub name: say the folder is missing
            raise TokenizerError(missing)
        try:
            self.tok = AutoTokenizer.from_pretrained(name_or_path)
        except Exception as exc:  # transformers raises OSError/ValueError/HTTP errors
            bad = _unreadable_json_in(name_or_path)
            raise TokenizerError(
                bad
                or (f"{missing}, and as a Hugging Face hub name: " if missing else "")
                + f"cannot load tokenizer {name_or_path!r} with transformers.AutoTokenizer: {type(exc).__name__}: {exc}"
            ) from exc
        self.name = name_or_path
        # ids may have holes: the largest id, not the count, decides what the storage dtype must hold
        self.vocab_size = int(max(len(self.tok), max(self.tok.get_vocab().values(), default=-1) + 1))
        self.eos_id = self.tok.eos_token_id
        self.hash = tokenizer_content_hash(self.tok)

    def encode_batch(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        ids = self.tok(
            list(texts),
            add_special_tokens=True,
            return_attention_mask=False,
            return_token_type_ids=False,
            verbose=False,
        )["input_ids"]
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        if len(ids) == 0:
            return lengths, np.zeros(0, self.dtype)
        if not lengths.sum():
            return lengths, np.zeros(0, self.dtype)
        flat = np.concatenate([np.asarray(x, dtype=np.int64) for x in ids])
        if flat.max() >= self.vocab_size or flat.min() < 0:  # never wrapped into the storage dtype
            bad = int(flat.max()) if flat.max() >= self.vocab_size else int(flat.min())
            raise TokenizerError(
                f"tokenizer {self.name!r} produced token id {bad}, outside its vocabulary of {self.vocab_size} ids "
                f"(stored as {self.dtype.name}): the tokenizer is inconsistent"
            )
        return lengths, flat.astype(self.dtype)


def tokenizer_content_hash(tok: Any) -> str:
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


def _path_like(spec: str) -> bool:
    """True when `spec` can only be a folder, never a hub name ("name" or "org/name")."""
    return (
        spec.startswith(("/", ".", "~")) or spec.count("/") > 1 or spec.endswith("/") or os.sep in spec.replace("/", "")
    )


def _missing_folder(spec: str) -> Optional[str]:
    """'tokenizer folder ... does not exist' (or is a file) for a spec that names no folder; None when it does."""
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        return None
    what = "is a file, not a folder" if os.path.exists(path) else "does not exist"
    return f"--tokenizer {spec!r}: the tokenizer folder {os.path.abspath(path)} {what}"


def load_tokenizer(spec: str) -> Tokenizer:
    """`"byte"` -> ByteTokenizer, anything else -> HFTokenizer(spec)."""
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)


# ----------------------------------------------------------------------------------------------------------------
# batch encoding of raw records for `balancer pretokenize` (runs in the main process or in spawn workers, so this
# module imports neither torch nor datasets). Record kinds: "json" (a raw JSON line, bytes), "obj" (a parsed JSON
# value holding the text field), "value" (the text field's value; None = missing), "bytes" (a whole .txt file).


@dataclass(frozen=True)
class EncoderConfig:
    """What an encoder process needs: the tokenizer spec and its expected hash, the text field, EOS or not."""

    tokenizer: str
    tokenizer_hash: str
    text_field: str
    add_eos: bool


_WORKER: dict = {}


def init_encoder(cfg: EncoderConfig, tok: Optional[Tokenizer] = None) -> None:
    """Set this process's encoder (a pool initializer): `tok` when given, else load `cfg.tokenizer` and check that
    its hash is the one the run started with."""
    _WORKER.clear()
    _WORKER["cfg"] = cfg
    if tok is None:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
        try:  # an initializer that raises makes multiprocessing.Pool respawn workers forever: report it per batch
            tok = load_tokenizer(cfg.tokenizer)
            if tok.hash != cfg.tokenizer_hash:
                raise TokenizerError(f"tokenizer {cfg.tokenizer!r} changed while running (hash {tok.hash})")
        except Exception as exc:  # noqa: BLE001
            _WORKER["error"] = exc
            return
    _WORKER["tok"] = tok


def utf8_problem(exc: UnicodeDecodeError, data: bytes, prefix: str = "", suffix: str = "") -> tuple[str, str]:
    """(reason, message) of bytes that do not decode: cut inside a character at the very end is a truncated input,
    not invalid UTF-8."""
    if exc.end >= len(data.rstrip(b"\r\n")) and "end of data" in exc.reason:
        return "truncated_utf8", f"{prefix}ends inside a UTF-8 character at byte {exc.start}{suffix} (truncated?)"
    return "invalid_utf8", f"{prefix}invalid UTF-8 at byte {exc.start}{suffix} ({exc.reason})"


def _decode(kind: str, payload: Any, field: str) -> tuple[Optional[str], Optional[tuple[str, str]]]:
    """(text, None) or (None, (reason, message))."""
    if kind == "json":
        if not payload.strip():
            return None, ("blank_line", "blank line")
        try:
            obj = json.loads(payload)
        except json.JSONDecodeError as exc:
            return None, ("bad_json", f"invalid JSON ({exc.msg.removesuffix(' at')} at column {exc.colno})")
        except UnicodeDecodeError as exc:
            return None, utf8_problem(exc, payload, suffix=" of the line")
        except RecursionError:
            return None, ("bad_json", f"invalid JSON (nested too deeply: over {sys.getrecursionlimit()} levels)")
        except ValueError as exc:  # an integer of more than 4300 digits
            return None, (
                "bad_json",
                f"invalid JSON ({'an integer of more than 4300 digits' if 'digits' in str(exc) else exc})",
            )
        kind, payload = "obj", obj
    if kind == "obj":
        if not isinstance(payload, dict):
            return None, ("not_object", f"expected a JSON object, got {type(payload).__name__}")
        payload = payload.get(field)
        kind = "value"
    if kind == "value":
        if payload is None:
            return None, ("missing_field", f"no text field {field!r} (or it is null)")
        if not isinstance(payload, str):
            return None, ("not_text", f"field {field!r} is {type(payload).__name__}, not a string")
        return payload, None
    if kind == "bytes":
        try:
            return payload.decode("utf-8"), None
        except UnicodeDecodeError as exc:
            line = payload.count(b"\n", 0, exc.start) + 1
            return None, utf8_problem(exc, payload, prefix=f"line {line}: ")
    raise ValueError(f"unknown record kind {kind}")  # pragma: no cover


def encode_payloads(payloads: list) -> tuple[np.ndarray, np.ndarray, dict]:
    """Encode one batch with the process's tokenizer. Returns (lengths int64 [n] with -1 for a bad record,
    flat ids of the good ones (EOS appended when configured), {index: (reason, message)})."""
    if "error" in _WORKER:
        raise _WORKER["error"]
    tok: Tokenizer = _WORKER["tok"]
    cfg: EncoderConfig = _WORKER["cfg"]
    n = len(payloads)
    errors: dict[int, tuple[str, str]] = {}
    texts: list[str] = []
    idx: list[int] = []
    for j, (kind, payload) in enumerate(payloads):
        text, err = _decode(kind, payload, cfg.text_field)
        if err is not None:
            errors[j] = err
        elif not text:  # "" (a decoded document without error is a str)
            errors[j] = ("empty", "empty document")
        else:
            texts.append(text)
            idx.append(j)
    if not texts:
        return np.full(n, -1, dtype=np.int64), np.zeros(0, tok.dtype), errors
    try:
        lens, flat = tok.encode_batch(texts)
    except Exception:  # find the culprits, encode the rest
        good_t, good_i = [], []
        for t, j in zip(texts, idx):
            try:
                tok.encode_batch([t])
                good_t.append(t)
                good_i.append(j)
            except Exception as exc:  # noqa: BLE001 - reported per record
                errors[j] = ("unencodable_text", f"cannot encode the text ({type(exc).__name__}: {exc})"[:300])
        texts, idx = good_t, good_i
        lens, flat = tok.encode_batch(texts)
    zero = np.flatnonzero(lens == 0)
    for z in zero:
        errors[idx[z]] = ("empty", "the tokenizer produced no tokens")
    if cfg.add_eos and len(texts):
        ends = np.cumsum(lens)
        keep = lens > 0
        flat = np.insert(flat, ends[keep], np.asarray(tok.eos_id, dtype=flat.dtype))
        lens = lens + keep
    lengths = np.full(n, -1, dtype=np.int64)
    lengths[np.asarray(idx, dtype=np.int64)] = lens
    lengths[[idx[z] for z in zero]] = -1
    return lengths, flat, errors
