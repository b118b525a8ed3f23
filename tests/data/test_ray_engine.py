"""`balancer pretokenize --engine ray` on a real local Ray cluster (one per module: Ray starts slowly): the same
rows and manifest as the local engine, slices + merge, a worker killed once (retried) or every time (a clear
error, whole shards only, then resume), a SIGKILLed driver resumed byte-identical, an unreachable address."""

from __future__ import annotations

import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import ray
import ray.cloudpickle
from support.data_files import make_texts, recorded_shards, write_jsonl, write_parquet

from balancer import cli
from balancer.data.pretokenize import ray_engine
from balancer.data.pretokenize.options import PretokenizeOptions
from balancer.data.pretokenize.pipeline import pretokenize
from balancer.data.shards.dataset import ShardDataset
from balancer.data.shards.errors import DataError
from balancer.data.shards.manifest import load_manifest
from balancer.data.shards.verify import verify

pytestmark = pytest.mark.slow  # a local Ray cluster: minutes

REPO = Path(__file__).resolve().parents[2]
OPTS = dict(max_length=64, shard_tokens=12_000, on_error="skip", add_eos=True)


def run(inputs, out, **kw):
    opt_names = {"text_field", "max_length", "overflow", "add_eos", "on_error", "shard_tokens"}
    opts = PretokenizeOptions(**{k: v for k, v in kw.items() if k in opt_names})
    rest = {k: v for k, v in kw.items() if k not in opt_names}
    return pretokenize([str(i) for i in inputs], out, options=opts, progress=False, **rest)


def files_except_manifest(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir()) if p.name != "manifest.json"}


def same_output(a, b) -> bool:
    """Equal folders, the manifest's `engine` entry aside."""
    ma, mb = load_manifest(a), load_manifest(b)
    ma.pop("engine"), mb.pop("engine")
    return ma == mb and files_except_manifest(a) == files_except_manifest(b)


@pytest.fixture(scope="module")
def cluster():
    """A local 2-CPU Ray cluster whose workers import this checkout; yields its address."""
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}},
    )
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # fault-injecting tasks defined here
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    texts = make_texts(700, seed=11)
    write_jsonl(d / "a.jsonl", texts[:400])
    with open(d / "a.jsonl", "a", encoding="utf-8") as f:  # records the run skips (and names)
        f.write('{"text": "unterminated\n\n{"body": "no text"}\n')
    (d / "b.jsonl.gz").write_bytes(gzip.compress((d / "a.jsonl").read_bytes()[:20000], mtime=0))
    write_parquet(d / "c.parquet", texts[400:700])
    return [d / "a.jsonl", d / "b.jsonl.gz", d / "c.parquet"]


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "local"
    run(corpus, out, **OPTS)
    assert len(load_manifest(out)["shards"]) >= 5 and load_manifest(out)["counts"]["skipped"]
    return out


def test_same_rows_and_manifest_as_local_engine_and_slices_merge(cluster, corpus, reference, tmp_path, monkeypatch):
    monkeypatch.setattr(ray_engine, "RANGE_RECORDS", 90)  # many tasks, consumed in input order
    m = run(corpus, tmp_path / "ray", engine="ray", **OPTS)
    assert m["engine"]["name"] == "ray" and load_manifest(reference)["engine"] == {"name": "local"}
    assert same_output(tmp_path / "ray", reference) and verify(tmp_path / "ray") == []
    parts = [str(tmp_path / f"part{i}") for i in range(2)]
    for i, part in enumerate(parts):
        run(corpus, part, engine="ray", num_shards=2, shard_index=i, **OPTS)
    assert cli.main(["merge", *parts, "--output", str(tmp_path / "merged")]) == 0
    ds, ref = ShardDataset(tmp_path / "merged"), ShardDataset(reference)
    assert len(ds) == len(ref) and np.array_equal(ds.doc_ids, ref.doc_ids)
    assert all(np.array_equal(ds[i]["input_ids"], ref[i]["input_ids"]) for i in range(0, len(ds), 7))


def _dying_task(marker: str, at_record: int):
    """An encode task that SIGKILLs its worker on the range starting at `at_record` while `marker` exists; with
    a marker holding 'once' it removes it first (the retry then succeeds)."""

    def task(batch, sources, cfg):
        # in a worker: the real task (patched in this process only)
        import balancer.data.pretokenize.ray_engine as engine

        start = json.loads(batch["range"].to_pylist()[0])[0]["record"]
        if start == at_record and os.path.exists(marker):
            if Path(marker).read_text() == "once":
                os.remove(marker)
            os.kill(os.getpid(), signal.SIGKILL)
        return engine._encode_task(batch, sources=sources, cfg=cfg)

    return task


def test_dead_worker_retried_then_clear_error_and_resume(cluster, corpus, reference, tmp_path, monkeypatch):
    monkeypatch.setattr(ray_engine, "RANGE_RECORDS", 150)
    monkeypatch.setattr(ray_engine, "TASK_RETRIES", 1)
    marker = tmp_path / "die"
    monkeypatch.setattr(ray_engine, "_encode_task", _dying_task(str(marker), at_record=300))
    marker.write_text("once")
    run(corpus, tmp_path / "retried", engine="ray", **OPTS)
    assert not marker.exists()  # the worker did die once
    assert same_output(tmp_path / "retried", reference)

    marker.write_text("always")
    out = tmp_path / "failed"
    failure = r"a task failed after 1 retries \(WorkerCrashedError: .*\) with records from (\d+) on \(.*a\.jsonl"
    with pytest.raises(DataError, match=failure + r" from record \1\) unfinished; .*rerun the same command"):
        run(corpus, out, engine="ray", **OPTS)
    assert not (out / "manifest.json").exists()
    state = json.loads((out / ".pretokenize-state.json").read_text())
    assert 0 < len(state["shards"]) and state["shards"][-1]["cursor"]["record"] <= 300  # whole shards before it
    marker.unlink()
    run(corpus, out, engine="ray", **OPTS)
    assert same_output(out, reference) and verify(out) == []


def test_killed_driver_resumes_byte_identical(cluster, tmp_path):
    src = write_jsonl(tmp_path / "big.jsonl", make_texts(3000, seed=7, max_words=400))
    args = ["--max-length", "500", "--shard-tokens", "120000", "--quiet"]
    ref = tmp_path / "ref"
    assert cli.main(["pretokenize", str(src), "--output", str(ref), *args]) == 0
    n_shards = len(load_manifest(ref)["shards"])
    assert n_shards >= 8
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "balancer", "pretokenize", str(src), "--output", str(out), *args]
    cmd += ["--engine", "ray", "--ray-address", cluster]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    state, t0 = out / ".pretokenize-state.json", time.time()
    while proc.poll() is None and time.time() - t0 < 90:
        if state.exists() and recorded_shards(out, state.name) >= 2:
            break
        time.sleep(0.02)
    assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "manifest.json").exists()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    resumed = [int(x) for x in __import__("re").findall(r"resuming after (\d+) finished shard", done.stderr)]
    assert resumed and 0 < resumed[0] < n_shards, done.stderr
    assert same_output(out, ref) and verify(out) == []


def test_unreachable_address_is_a_clear_error(tmp_path, capsys):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    argv = ["pretokenize", str(tmp_path / "a.jsonl"), "--output", str(tmp_path / "o"), "--engine", "ray"]
    assert cli.main([*argv, "--ray-address", f"127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err
    assert f"--ray-address 127.0.0.1:{port}: cannot reach 127.0.0.1:{port}" in err and "Traceback" not in err
    assert cli.main([*argv, "--ray-address", "nonsense"]) == 2
    assert "expected HOST:PORT" in capsys.readouterr().err
    assert cli.main(argv[:-2] + ["--ray-address", "127.0.0.1:1"]) == 2  # without --engine ray
    assert "--ray-address needs --engine ray" in capsys.readouterr().err
