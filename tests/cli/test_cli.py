import json
import os
import stat
import subprocess
import sys

import numpy as np
import pytest

import balancer
from balancer.cli import main


def run(*args):
    return subprocess.run([sys.executable, "-m", "balancer", *args], capture_output=True, text=True, timeout=300)


def test_plan_json_lengths_writes_plan(tmp_path, capsys):
    lengths = np.random.default_rng(0).integers(1, 5000, 3000).tolist()
    src = tmp_path / "lengths.json"
    src.write_text(json.dumps(lengths))
    out = tmp_path / "plan.json"
    assert main(["plan", str(src), "--dp", "4", "--cp", "2", "--pp", "2", "--micro-batches", "4", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "imbalance" in text and "token-count" in text and "speedup vs token-count" in text
    p = balancer.Plan.load(out)
    p.validate()
    assert p.topology.dp == 4 and p.topology.max_tokens == 4096  # next power of two >= 4999 / 2


def test_plan_npy_and_model_cost(tmp_path, capsys):
    src = tmp_path / "l.npy"
    np.save(src, np.random.default_rng(1).integers(1, 9000, 2000))
    out = tmp_path / "plan.npz"
    assert main(["plan", str(src), "--model", "llama3-8b", "--dp", "2", "-o", str(out), "--no-baseline"]) == 0
    p = balancer.Plan.load(out)
    assert p.cost_model == balancer.CostModel.from_model(
        **__import__("balancer.cli.options").cli.options.MODELS["llama3-8b"]
    )


@pytest.mark.slow  # matplotlib: ~6 s
def test_stats_plot(tmp_path):
    src = tmp_path / "l.txt"
    src.write_text("\n".join(str(x) for x in np.random.default_rng(2).integers(1, 70000, 1500)))
    png = tmp_path / "stats.png"
    r = run("stats", str(src), "--dp", "2", "--plot", str(png))
    assert r.returncode == 0, r.stderr
    assert "32K" in r.stdout and "attention" in r.stdout and "imbalance" in r.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "content, match",
    [
        ("[1, 2, 0]", "document 2 has no tokens"),
        ("[1, 2.5]", "not an integer"),
        ("[]", "empty"),
        ("{oops", "invalid JSON"),
    ],
)
def test_plan_bad_input_clear_error(tmp_path, content, match):
    src = tmp_path / "bad.json"
    src.write_text(content)
    r = run("plan", str(src), "--dp", "1")
    assert r.returncode == 2
    assert match in r.stderr and "bad.json" in r.stderr or match in r.stderr


def test_text_file_bad_line_names_line(tmp_path):
    src = tmp_path / "l.txt"
    src.write_text("5\n7\nseven\n")
    r = run("plan", str(src), "--dp", "1")
    assert r.returncode == 2 and "l.txt:3" in r.stderr


def test_document_over_cap_names_it(tmp_path):
    src = tmp_path / "l.json"
    src.write_text(json.dumps([10, 20, 5000, 30]))
    r = run("plan", str(src), "--dp", "1", "--max-tokens", "1024")
    assert r.returncode == 2 and "document 2 has 5000 tokens" in r.stderr and "overflow" in r.stderr
    r = run(
        "plan", str(src), "--dp", "1", "--max-tokens", "1024", "--overflow", "split", "-o", str(tmp_path / "p.json")
    )
    assert r.returncode == 0, r.stderr


def test_impossible_topology(tmp_path):
    src = tmp_path / "l.json"
    src.write_text("[1, 2, 3]")
    r = run("plan", str(src), "--dp", "4")
    assert r.returncode == 2 and "cannot fill" in r.stderr and "lower --dp or --micro-batches" in r.stderr
    r = run("plan", str(src), "--dp", "1", "--tokens-per-step", "999999", "--max-tokens", "4")
    assert r.returncode == 2 and "exceeds the capacity" in r.stderr


def test_demo_runs():
    r = run("demo")
    assert r.returncode == 0, r.stderr
    assert "balancer" in r.stdout and "token-count" in r.stdout and "faster than token-count" in r.stdout


def test_help_explains_options():
    r = run("plan", "--help")
    for opt in (
        "--dp",
        "--cp",
        "--pp",
        "--micro-batches",
        "--max-tokens",
        "--tokens-per-step",
        "--overflow",
        "--model-config",
    ):
        assert opt in r.stdout


def test_plan_without_output_writes_beside_the_input_and_follows_umask(tmp_path, capsys):
    src = tmp_path / "lengths.json"
    src.write_text(json.dumps(np.random.default_rng(3).integers(1, 900, 300).tolist()))
    old = os.umask(0o027)
    try:
        assert main(["plan", str(src), "--dp", "2", "--no-baseline"]) == 0
    finally:
        os.umask(old)
    out = tmp_path / "lengths.plan_dp2_cp1_pp1_m4.json"
    assert f"wrote {out}" in capsys.readouterr().err
    assert stat.S_IMODE(out.stat().st_mode) == 0o640
    balancer.Plan.load(out).validate()


def test_plan_of_a_folder_writes_next_to_it_not_inside(tmp_path, capsys):
    tok = tmp_path / "tok"
    assert (
        main(["pretokenize", str(_corpus(tmp_path)), "--output", str(tok), "--max-length", "64", "--overflow", "split"])
        == 0
    )
    before = sorted(p.name for p in tok.iterdir())
    assert main(["plan", str(tok), "--dp", "1", "--micro-batches", "2"]) == 0
    assert sorted(p.name for p in tok.iterdir()) == before
    assert (tmp_path / "tok.plan_dp1_cp1_pp1_m2.json").is_file()
    capsys.readouterr()
    # stats names the folder's rows as rows: some are windows of longer documents
    assert main(["stats", str(tok), "--dp", "1", "--micro-batches", "2", "--quiet"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("rows ") and "from 6 documents (2 split into windows" in text


def _corpus(tmp_path):
    src = tmp_path / "c.jsonl"
    docs = ["short text"] * 4 + ["word " * 40, "long " * 50]
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    return src


@pytest.mark.parametrize("overflow", ["split", "truncate"])
def test_overflow_keeps_the_comparison_column(tmp_path, capsys, overflow):
    src = tmp_path / "l.json"
    src.write_text(json.dumps([10, 20, 5000, 30] * 50))
    assert main(["plan", str(src), "--dp", "1", "--max-tokens", "1024", "--overflow", overflow]) == 0
    text = capsys.readouterr().out
    assert "token-count" in text and "speedup vs token-count" in text and "speedup vs balancer" not in text


def test_errors_name_flags_not_python(tmp_path, capsys):
    src = tmp_path / "l.json"
    src.write_text(json.dumps([10, 20, 5000, 30]))
    assert main(["plan", str(src), "--dp", "1", "--max-tokens", "1024"]) == 2
    err = capsys.readouterr().err
    assert "--overflow split (windows) or --overflow truncate" in err
    assert "raise --max-tokens or --cp" in err and "overflow='" not in err
    assert main(["plan", str(src), "--dp", "1", "--tokens-per-step", "999999", "--max-tokens", "8192"]) == 2
    err = capsys.readouterr().err
    assert "--tokens-per-step=999999 exceeds" in err and "Topology." not in err


def test_missing_optional_dependencies_name_the_extra(tmp_path, capsys, monkeypatch):
    from balancer.data.pretokenize.tokenize import HFTokenizer, TokenizerError

    src = tmp_path / "l.json"
    src.write_text("[1, 2, 3]")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert main(["stats", str(src), "--dp", "1", "--plot", str(tmp_path / "x.png")]) == 2
    out = capsys.readouterr()
    assert "seqbalancer[plot]" in out.err and out.out == ""  # checked before any statistics are printed
    with pytest.raises(TokenizerError, match=r"seqbalancer\[hf\]"):
        HFTokenizer("some/tokenizer")
