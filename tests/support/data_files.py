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


def recorded_shards(out: Path, state_name: str) -> int:
    """Shards the run state in `out` records: its state file's and its journal's since (pretokenize, merge and pack: one
    line per record, balancer.data.shards.journal); 0 while there is no state."""
    try:
        recorded = len(json.loads((out / state_name).read_text())["shards"])
    except (FileNotFoundError, ValueError, KeyError):
        return 0
    try:
        lines = (out / (state_name + ".journal")).read_bytes().split(b"\n")
    except FileNotFoundError:
        return recorded
    return recorded + sum(1 for line in lines if line[9:19] == b'{"shard":{')


def kill_at_progress(cmd: list[str], out: Path, state_name: str, ref: Path, stretches: int, seed: int) -> list[str]:
    """SIGKILL `cmd` (a run writing `out`) once during start-up, then once inside each of `stretches` disjoint,
    later stretches of its writing phase, keyed to the shards its state file records, not to the clock; rerun the
    same command after each kill. A run that outpaces the watcher and finishes must equal `ref` byte for byte, and
    the folder starts over. Returns the runs' stderr; fails if a run ends by itself without success."""
    import shutil
    import signal
    import subprocess
    import time

    repo = Path(__file__).resolve().parents[2]
    n_shards = len(json.loads((ref / "manifest.json").read_text())["shards"])
    rng = random.Random(seed)

    def finished_shards() -> int:  # the state file is replaced atomically: read it afresh on every poll
        return recorded_shards(out, state_name)

    def wait_for(proc, target: int) -> None:
        """Until `target` shards are recorded, then a random moment within about one more shard's time."""
        seen, changes = finished_shards(), [time.time()]
        while seen < target and proc.poll() is None:
            time.sleep(0.003)
            now = finished_shards()
            if now != seen:
                seen, changes = now, [*changes[-1:], time.time()]
        time.sleep(rng.uniform(0.0, changes[-1] - changes[0] if len(changes) == 2 else 0.02))

    logs: list[str] = []
    outcomes: list[str] = []
    stretch = 0
    while stretch <= stretches and len(outcomes) < 4 * (stretches + 1):
        proc = subprocess.Popen(cmd, cwd=repo, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if stretch == 0:
            time.sleep(rng.uniform(0.05, 0.8))  # inside the interpreter's start-up, imports, the first state write
        else:
            span = n_shards / (stretches + 1)
            wait_for(proc, rng.randrange(int(stretch * span), max(int((stretch + 1) * span), int(stretch * span) + 1)))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        logs.append(proc.communicate()[1].decode())
        # a run that ended by itself must have succeeded: a refusal after a kill is a crash-safety bug
        assert proc.returncode in (0, -signal.SIGKILL), (outcomes, proc.returncode, logs[-1])
        if proc.returncode == 0:
            outcomes.append(f"finished in stretch {stretch}")
            assert dir_bytes(out) == dir_bytes(ref), outcomes
            shutil.rmtree(out)
            stretch = 0
        else:
            outcomes.append(f"killed in stretch {stretch}")
            stretch += 1
    assert stretch > stretches, outcomes
    return logs
