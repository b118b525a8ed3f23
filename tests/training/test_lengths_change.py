"""Inputs that change under us: a memory-mapped lengths `.npy` rewritten, truncated or deleted during an epoch is
noticed before the next window is read (size, mtime and inode; the lengths fingerprinted again on a rewrite) and
refused with one error naming the file, never a SIGBUS and never a plan mixing new and old lengths; a change undone
is no change, and a resume after a change and its restore continues."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import balancer

COST = balancer.CostModel(attn_coef=1.0, linear_coef=50.0)
TOPO = balancer.Topology(dp=2, cp=1, micro_batches=2, max_tokens=512, tokens_per_step=1700)
LENGTHS = np.random.default_rng(8).integers(1, 300, 4000)
WINDOW = 500


def _write(path, values) -> None:
    np.save(path, np.asarray(values, dtype=np.int64))


def _sampler(path, rank=0):
    return balancer.BalancedBatchSampler(np.load(path, mmap_mode="r"), TOPO, COST, dp_rank=rank, window_docs=WINDOW)


def _first_window(s):
    it = iter(s)
    n = s.windows.steps(0) * TOPO.micro_batches
    return it, [next(it) for _ in range(n // 3)]  # before the next window is planned ahead


def _rewrite_in_place(path, values) -> None:
    """New values into the same file (same inode, same size): what the map then reads."""
    with open(path, "r+b") as f:
        header = len(open(path, "rb").read()) - 8 * len(values)
        f.seek(header)
        f.write(np.asarray(values, dtype="<i8").tobytes())


@pytest.mark.parametrize("change", ["rewrite", "replace", "delete"])
def test_a_changed_lengths_file_is_refused_before_the_next_window(tmp_path, change):
    path = tmp_path / "lengths.npy"
    _write(path, LENGTHS)
    s = _sampler(path)
    it, _ = _first_window(s)
    other = LENGTHS.copy()
    other[::7] += 1
    if change == "rewrite":
        _rewrite_in_place(path, other)
        os.utime(path, ns=(1, 1))  # a different mtime even on a coarse clock
        match = "rewritten during the epoch"
    elif change == "replace":
        _write(tmp_path / "new.npy", other)
        os.replace(tmp_path / "new.npy", path)
        match = "rewritten during the epoch"
    else:
        path.unlink()
        match = "deleted during the epoch"
    with pytest.raises(ValueError, match=f"{path}: the lengths file was {match.split()[0]}.*before window 1"):
        list(it)


def test_a_truncated_lengths_file_is_refused_not_a_sigbus(tmp_path):
    path = tmp_path / "lengths.npy"
    _write(path, LENGTHS)
    code = textwrap.dedent(
        f"""
        import os, numpy as np, balancer
        cost = balancer.CostModel(attn_coef=1.0, linear_coef=50.0)
        topo = balancer.Topology(dp=2, cp=1, micro_batches=2, max_tokens=512, tokens_per_step=1700)
        s = balancer.BalancedBatchSampler(np.load({str(path)!r}, mmap_mode="r"), topo, cost, dp_rank=0,
                                          window_docs={WINDOW})
        it = iter(s)
        next(it)
        os.truncate({str(path)!r}, 4096)  # most of the lengths gone under the map
        try:
            list(it)
        except ValueError as e:
            print("REFUSED", e)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ, timeout=300)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])  # a SIGBUS is returncode -7
    assert "REFUSED" in out.stdout and "changed size during the epoch" in out.stdout, out.stdout


def test_a_change_undone_is_no_change_and_a_resume_after_a_restore_continues(tmp_path):
    path = tmp_path / "lengths.npy"
    _write(path, LENGTHS)
    full = [list(_sampler(path, r)) for r in range(TOPO.dp)]
    s = _sampler(path)
    it, head = _first_window(s)
    _write(path, LENGTHS)  # written again with the same lengths (a new mtime): nothing changed
    assert head + list(it) == full[0]

    s = _sampler(path, rank=1)
    it, head = _first_window(s)
    state = s.state_dict()
    other = LENGTHS.copy()
    other[3] += 5
    _write(path, other)
    with pytest.raises(ValueError, match="another data set"):  # a resume onto the changed file: refused
        _sampler(path, rank=1).load_state_dict(state)
    _write(path, LENGTHS)  # restored: the resume continues exactly
    again = _sampler(path, rank=1)
    again.load_state_dict(state)
    assert head + list(again) == full[1]
