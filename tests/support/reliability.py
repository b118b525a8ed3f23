"""Helpers for the reliability tests: a small pretokenized folder, tampering, and the CLI run in-process."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from balancer.data.pretokenize.options import PretokenizeOptions  # noqa: E402
from balancer.data.pretokenize.pipeline import pretokenize  # noqa: E402
from support.data_files import make_texts, write_jsonl  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def make_corpus(folder: Path, n: int = 120, seed: int = 3) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return write_jsonl(folder / "c.jsonl", make_texts(n, seed=seed, max_words=120))


def tokenize(inputs, out, **opts) -> dict:
    """In-process byte-tokenizer pretokenize; options as keywords (shard_tokens small: several shards)."""
    run_args = {k: opts.pop(k) for k in ("overwrite", "num_shards", "shard_index") if k in opts}
    opts.setdefault("shard_tokens", 4000)
    return pretokenize([str(i) for i in inputs], out, options=PretokenizeOptions(**opts), progress=False, **run_args)


def copy_folder(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_manifest(folder: Path, change) -> None:
    """Apply `change(manifest)` to folder/manifest.json in place."""
    path = folder / "manifest.json"
    m = json.loads(path.read_text())
    change(m)
    path.write_text(json.dumps(m))


def flip_byte(path: Path, offset_from_end: int = 9) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x01
    path.write_bytes(bytes(data))


def cli(capsys, *argv) -> tuple[int, list[str]]:
    """Run `balancer ARGV` in-process: (exit code, non-empty stderr lines)."""
    from balancer.cli import main

    capsys.readouterr()
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.strip()]


def start_child(work, stderr_path: Path, start_fd: int | None = None) -> int:
    """Fork a process running `work()` (-> exit code; no interpreter start-up to pay), its stderr into a file;
    with `start_fd`, it first waits for one byte on that pipe. Returns the pid."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover (child)
        code = 99
        try:
            sys.stderr = open(stderr_path, "w")
            if start_fd is not None:
                os.read(start_fd, 1)
            code = work()
        except BaseException:  # noqa: BLE001
            import traceback

            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    return pid


def wait_child(pid: int) -> int:
    """Exit code of a child, or -signal when it was killed."""
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def in_child(work, stderr_path: Path) -> int:
    return wait_child(start_child(work, stderr_path))
