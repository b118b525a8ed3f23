"""balancer.integrations.trl_grpo.BalancedGRPOTrainer: TRL's GRPOTrainer, run for real on CPU (a tiny Llama saved
from a config, a tokenizer trained here, a local reward function, generation by the model itself, no vLLM), moves
the weights after one step exactly as the stock GRPOTrainer does on the same rollouts, for the loss types whose
value does not depend on micro-batch membership (the KL term and sequence-level importance sampling included).

Same data: the stock trainer generates and scores; its generation batch is recorded and handed to the balanced
trainer, which re-slices it into balanced, packed micro-batches. Also on 2 processes (each rank its own rollouts).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.data_files import make_texts, train_hf_tokenizer  # noqa: E402
from support.trainer import PLAIN_SGD, relative_error, run_torchrun_world, tiny_llama  # noqa: E402

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

pytestmark = pytest.mark.slow  # TRL trainer runs with generation (and a gloo world)

TOL = 3e-4  # fp32 packed vs padded


def _model_dir(root: Path) -> Path:
    """A tokenizer trained here and a tiny Llama of its vocabulary, saved (the reference model loads from it)."""
    from transformers import AutoTokenizer

    folder = root / "model"
    if not (folder / "config.json").exists():
        train_hf_tokenizer(folder, make_texts(40, seed=3), vocab_size=300)
        tok = AutoTokenizer.from_pretrained(str(folder))
        tok.pad_token = tok.eos_token
        tok.save_pretrained(str(folder))
        model = tiny_llama(vocab_size=len(tok))
        model.config.eos_token_id, model.config.pad_token_id = tok.eos_token_id, tok.pad_token_id
        # a random model rarely says EOS: let one token in ten end a completion, so completions differ in length
        model.generation_config.eos_token_id = [tok.eos_token_id, *range(10, len(tok), 10)]
        model.save_pretrained(str(folder))
    return folder


def reward_length(completions, **kwargs) -> list[float]:
    """A local reward: longer completions score higher (different rewards inside a group give advantages)."""
    return [float(len(c)) for c in completions]


def _config(out: Path, **kw):
    return trl.GRPOConfig(
        output_dir=str(out),
        **{**PLAIN_SGD, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "max_steps": 1},
        num_generations=4,
        max_completion_length=12,
        bf16=False,
        seed=0,
        **kw,
    )


def _clone(out: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in out.items()}


def _deltas(root: Path, out: Path, **kw) -> tuple[dict, dict]:
    """(stock, balanced) weight changes of one step on the same rollouts."""
    from transformers import AutoTokenizer

    from balancer.integrations.trl_grpo import BalancedGRPOTrainer

    folder = _model_dir(root)
    tok = AutoTokenizer.from_pretrained(str(folder))
    prompts = datasets.Dataset.from_dict({"prompt": make_texts(8, seed=5, max_words=6)})
    deltas, recorded = [], {}
    for cls in (trl.GRPOTrainer, BalancedGRPOTrainer):
        trainer = cls(
            model=str(folder),
            reward_funcs=[reward_length],
            args=_config(out / cls.__name__, **kw),
            train_dataset=prompts,
            processing_class=tok,
        )
        start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        generate = trainer._generate_and_score_completions
        if not recorded:

            def record(batch, generate=generate):
                recorded["out"] = _clone(generate(batch))
                return _clone(recorded["out"])

            trainer._generate_and_score_completions = record
        else:
            trainer._generate_and_score_completions = lambda batch: _clone(recorded["out"])
        trainer.train()
        deltas.append({n: p.detach() - start[n] for n, p in trainer.model.named_parameters()})
    lengths = recorded["out"]["completion_mask"].sum(1)
    assert len(set(lengths.tolist())) > 1  # completions of different lengths: packing differs from padding
    return deltas[0], deltas[1]


CASES = {
    "grpo+kl": dict(loss_type="grpo", beta=0.05),
    "dapo": dict(loss_type="dapo"),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "luspo-sequence": dict(loss_type="luspo", importance_sampling_level="sequence"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_step_equals_stock_grpo(tmp_path_factory, tmp_path, case):
    root = tmp_path_factory.getbasetemp() / "grpo-model"
    want, got = _deltas(root, tmp_path, **CASES[case])
    assert sum(float(v.abs().sum()) for v in want.values()) > 0  # the step moved the weights
    assert relative_error(got, want) <= TOL, relative_error(got, want)


def _world(rank, world, root, out):
    stock, balanced = _deltas(Path(root), Path(out) / f"rank{rank}", loss_type="grpo")
    if rank == 0:
        torch.save({"stock": stock, "balanced": balanced}, Path(out) / "deltas.pt")


def test_two_processes_equal_stock(tmp_path_factory, tmp_path):
    root = tmp_path_factory.getbasetemp() / "grpo-model"
    _model_dir(root)
    run_torchrun_world(2, _world, str(root), str(tmp_path))
    d = torch.load(tmp_path / "deltas.pt")
    assert relative_error(d["balanced"], d["stock"]) <= TOL, relative_error(d["balanced"], d["stock"])


def test_unsupported_settings_are_refused(tmp_path_factory, tmp_path):
    from transformers import AutoTokenizer

    from balancer.integrations.trl_grpo import BalancedGRPOTrainer

    folder = _model_dir(tmp_path_factory.getbasetemp() / "grpo-model")
    tok = AutoTokenizer.from_pretrained(str(folder))
    prompts = datasets.Dataset.from_dict({"prompt": make_texts(8, seed=5, max_words=6)})
    for kw, match in [({"top_entropy_quantile": 0.5}, "top_entropy_quantile"), ({"loss_type": "vespo"}, "vespo")]:
        with pytest.raises(ValueError, match=match):
            BalancedGRPOTrainer(
                model=str(folder), reward_funcs=[reward_length], args=_config(tmp_path, **kw), train_dataset=prompts,
                processing_class=tok,
            )  # fmt: skip
