"""What the Trainer integration refuses, with a clear message, and the CP-context guard: a model still on its default
attention inside `attention.hf.cp_context` raises instead of silently ignoring the layout. Also: `import balancer`
does not import transformers or TRL."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from support.trainer import tiny_llama, token_rows, training_args  # noqa: E402

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

REPO = Path(__file__).resolve().parents[2]


def _make(tmp_path, topo, rows=None, **kw):
    import balancer.hf

    args = kw.pop("args", None) or training_args(tmp_path)
    ds = datasets.Dataset.from_dict({"input_ids": rows or token_rows(8, seed=0)})
    return balancer.hf.BalancedTrainer(model=tiny_llama(), args=args, train_dataset=ds, topology=topo, **kw)


def test_import_balancer_does_not_import_transformers():
    code = "import sys, balancer; assert not {'transformers', 'trl'} & set(sys.modules), sorted(sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_conflicting_gradient_accumulation_is_an_error(tmp_path):
    import balancer

    topo = balancer.Topology(dp=1, cp=1, micro_batches=4, max_tokens=128)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=3 conflicts .* micro_batches=4"):
        _make(tmp_path, topo, args=training_args(tmp_path, gradient_accumulation_steps=3))
    trainer = _make(tmp_path, topo, args=training_args(tmp_path, gradient_accumulation_steps=4))
    assert trainer.args.gradient_accumulation_steps == 4
    user_args = training_args(tmp_path)
    assert _make(tmp_path, topo, args=user_args).args.gradient_accumulation_steps == 4
    assert user_args.gradient_accumulation_steps == 1  # the caller's arguments are not modified


def test_unsupported_topologies_and_launch(tmp_path):
    import balancer

    with pytest.raises(ValueError, match="pipeline parallelism"):
        _make(tmp_path, balancer.Topology(dp=1, cp=1, pp=2, micro_batches=2, max_tokens=128))
    with pytest.raises(ValueError, match="torchrun --nproc-per-node 2"):
        _make(tmp_path, balancer.Topology(dp=1, cp=2, micro_batches=2, max_tokens=128))
    with pytest.raises(ValueError, match="torchrun --nproc-per-node 2"):  # a dynamic-CP pool of 2 ranks
        _make(tmp_path, balancer.Topology(dp=1, cp=2, micro_batches=2, max_tokens=128, cp_sizes=(1, 2)))
    with pytest.raises(ValueError, match="compute_metrics is not supported"):  # packed eval has no predictions
        _make(tmp_path, balancer.Topology(dp=1, micro_batches=2, max_tokens=128), compute_metrics=lambda p: {})


def test_default_topology_from_training_arguments(tmp_path):
    """No topology: dp = world size (1 here), micro_batches = gradient accumulation, max_tokens = batch size x the
    longest training document, a step about as many tokens as the stock step's documents."""
    rows = token_rows(8, seed=0)
    args = training_args(tmp_path, gradient_accumulation_steps=2, per_device_train_batch_size=3)
    trainer = _make(tmp_path, None, rows=rows, args=args)
    t = trainer.topology
    longest, mean = max(len(r) for r in rows), sum(len(r) for r in rows) / len(rows)
    assert (t.dp, t.cp, t.micro_batches, t.max_tokens) == (1, 1, 2, 3 * longest)
    assert t.tokens_per_step == round(3 * 2 * mean)
    with pytest.raises(NotImplementedError, match="predict"):
        trainer.predict(trainer.train_dataset)


def test_dataset_without_input_ids_and_long_documents(tmp_path):
    import balancer.hf

    topo = balancer.Topology(dp=1, cp=1, micro_batches=2, max_tokens=16)
    with pytest.raises(ValueError, match="no 'input_ids' column"):
        balancer.hf.BalancedTrainer(
            model=tiny_llama(),
            args=training_args(tmp_path),
            train_dataset=datasets.Dataset.from_dict({"text": ["a b", "c"]}),
            topology=topo,
        )
    with pytest.raises(ValueError, match="overflow='split'"):
        _make(tmp_path, topo)  # a 40-token document, 16 tokens per micro-batch
    trainer = _make(tmp_path, topo, overflow="split", args=training_args(tmp_path, max_steps=2))
    trainer.train()  # windows of <= 16 tokens through SpanDataset
    assert trainer.state.global_step == 2


def _layout(lengths, cp_size=1):
    import attention

    return attention.CPLayout.build(np.concatenate([[0], np.cumsum(lengths)]), cp_size)


def test_cp_context_refuses_a_model_on_its_default_attention():
    import attention.hf as ahf

    model = tiny_llama("sdpa")
    ids = torch.randint(0, 64, (1, 9))
    with pytest.raises(ValueError, match="attention is 'sdpa'"):
        with ahf.cp_context(_layout([4, 5]), model=model):
            pass
    with pytest.raises(RuntimeError, match="no attention ran through 'cp_attention'"):
        with ahf.cp_context(_layout([4, 5])):
            model(input_ids=ids)  # sdpa ignores the layout: caught when the block ends


def test_cp_context_single_rank_equals_per_document():
    import attention.hf as ahf

    ahf.register()
    ref = tiny_llama("sdpa").double()
    model = tiny_llama(ahf.NAME).double()
    ids = torch.randint(0, 64, (9,))
    layout = _layout([4, 5])
    with ahf.cp_context(layout, model=model):  # one CP rank: no process group needed
        got = model(input_ids=ids[None], position_ids=torch.from_numpy(layout.position_ids(0))[None]).logits[0]
    want = torch.cat([ref(input_ids=ids[None, a:b]).logits[0] for a, b in ((0, 4), (4, 9))])
    assert (got - want).abs().max() <= 1e-9 * want.abs().max()
