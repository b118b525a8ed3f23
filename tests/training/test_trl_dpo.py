"""balancer.integrations.trl_dpo.BalancedDPOTrainer: TRL's DPOTrainer on balanced, packed micro-batches moves the
weights exactly as the stock DPOTrainer does on the same preference pairs (one SGD step, lr 1, fp32, a tiny Llama
from a config, a tokenizer trained here), for per-pair loss types, and on 2 processes (dp2) as the stock trainer on
one process over the same step. Loss types whose value depends on which pairs share a micro-batch are refused."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from support.data_files import make_texts, train_hf_tokenizer  # noqa: E402
from support.trainer import PLAIN_SGD, relative_error, run_torchrun_world, tiny_llama  # noqa: E402

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

pytestmark = pytest.mark.slow  # TRL trainer runs (and a gloo world)

TOL = 3e-4  # fp32 packed vs padded, as for the SFT trainer
N_PAIRS = 8  # one optimizer step: 2 pairs x 2 micro-batches x 2 processes, or 4 pairs x 2 on one process


def _tokenizer(folder: Path):
    from transformers import AutoTokenizer

    if not (folder / "tokenizer.json").exists():
        train_hf_tokenizer(folder, make_texts(40, seed=3), vocab_size=300)
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.pad_token = tok.eos_token
    return tok


def _pairs() -> datasets.Dataset:
    t = make_texts(3 * N_PAIRS, seed=11, max_words=12)
    return datasets.Dataset.from_dict({"prompt": t[:N_PAIRS], "chosen": t[N_PAIRS:-N_PAIRS], "rejected": t[-N_PAIRS:]})


def _config(out, batch: int, loss_type, **kw):
    return trl.DPOConfig(
        output_dir=str(out),
        **{**PLAIN_SGD, "per_device_train_batch_size": batch, "gradient_accumulation_steps": 2, "max_steps": 1},
        max_length=None,
        beta=0.5,
        loss_type=loss_type,
        bf16=False,
        **kw,
    )


def _delta(trainer, start) -> dict:
    trainer.train()
    return {n: p.detach() - start[n] for n, p in trainer.model.named_parameters()}


def _run(out: Path, balanced: bool, batch: int, loss_type, tok) -> dict:
    from balancer.integrations.trl_dpo import BalancedDPOTrainer

    model, ref = tiny_llama(vocab_size=len(tok)), tiny_llama(vocab_size=len(tok))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    cls = BalancedDPOTrainer if balanced else trl.DPOTrainer
    args = _config(out, batch, loss_type)
    trainer = cls(model=model, ref_model=ref, args=args, train_dataset=_pairs(), processing_class=tok)
    return _delta(trainer, start)


@pytest.mark.parametrize("loss_type", [["sigmoid"], ["ipo", "bco_pair"]], ids=["sigmoid", "ipo+bco_pair"])
def test_one_step_equals_stock_dpo(tmp_path, loss_type):
    tok = _tokenizer(tmp_path / "tok")
    want = _run(tmp_path / "stock", False, N_PAIRS // 2, loss_type, tok)
    got = _run(tmp_path / "balanced", True, N_PAIRS // 2, loss_type, tok)
    assert relative_error(got, want) <= TOL, relative_error(got, want)
    assert sum(float(v.abs().sum()) for v in want.values()) > 0  # the step moved the weights


def _world(rank, world, out_dir):
    tok = _tokenizer(Path(out_dir) / "tok")
    delta = _run(Path(out_dir) / f"balanced{rank}", True, N_PAIRS // 4, ["sigmoid"], tok)
    if rank == 0:
        torch.save(delta, Path(out_dir) / "delta.pt")


def test_two_processes_equal_stock_on_one(tmp_path):
    tok = _tokenizer(tmp_path / "tok")
    want = _run(tmp_path / "stock", False, N_PAIRS // 2, ["sigmoid"], tok)
    run_torchrun_world(2, _world, str(tmp_path))
    got = torch.load(tmp_path / "delta.pt")
    assert relative_error(got, want) <= TOL, relative_error(got, want)


@pytest.mark.parametrize("loss_type", [["aot"], ["sft"], ["sigmoid", "aot_unpaired"]])
def test_membership_dependent_losses_are_refused(tmp_path, loss_type):
    from balancer.integrations.trl_dpo import BalancedDPOTrainer

    tok = _tokenizer(tmp_path / "tok")
    model = tiny_llama(vocab_size=len(tok))
    with pytest.raises(ValueError, match="per-pair losses"):
        BalancedDPOTrainer(
            model=model,
            ref_model=copy.deepcopy(model),
            args=_config(tmp_path, 2, loss_type),
            train_dataset=_pairs(),
            processing_class=tok,
        )
