"""balancer.hf.BalancedSFTTrainer: TRL tokenizes a prompt/completion text dataset with a locally trained tokenizer
and masks the prompts; one SGD step over a step holding every example moves the weights as unpacked training on the
completion tokens does. SFTConfig settings that would pack or truncate behind the plan's back are refused."""

from __future__ import annotations

import pytest
from support.data_files import make_texts, train_hf_tokenizer  # noqa: E402
from support.trainer import PLAIN_SGD, relative_error, tiny_llama, unpacked_sgd_delta  # noqa: E402

pytest.importorskip("trl")

pytestmark = pytest.mark.slow  # trl SFTTrainer runs
datasets = pytest.importorskip("datasets")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = train_hf_tokenizer(tmp_path_factory.mktemp("tok"), make_texts(40, seed=3), vocab_size=300)
    return AutoTokenizer.from_pretrained(str(folder))


def _sft_config(out, **kw):
    from trl import SFTConfig

    # fp32 proof; gradient_checkpointing stays on (TRL's default): its recomputation needs the layout too
    return SFTConfig(output_dir=str(out), **{**PLAIN_SGD, "max_length": None, "bf16": False, **kw})


def _prompt_completion(n: int) -> datasets.Dataset:
    texts = make_texts(2 * n, seed=4, max_words=12)
    return datasets.Dataset.from_dict({"prompt": texts[:n], "completion": texts[n:]})


def test_sft_one_step_equals_unpacked_completion_loss(tmp_path, tokenizer):
    import balancer
    import balancer.hf

    model = tiny_llama(vocab_size=len(tokenizer))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    big = balancer.Topology(dp=1, cp=1, micro_batches=2, max_tokens=4096, tokens_per_step=None)
    trainer = balancer.hf.BalancedSFTTrainer(
        model=model,
        args=_sft_config(tmp_path),
        train_dataset=_prompt_completion(6),
        processing_class=tokenizer,
        topology=big,
    )
    rows = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    ids, labels = [r["input_ids"].tolist() for r in rows], [r["labels"].tolist() for r in rows]
    assert all(-100 in lab for lab in labels)  # prompts are masked: the normaliser is not the token count
    assert trainer.balanced_sampler.num_steps == 1
    trainer.train()
    got = {n: p.detach() - start[n] for n, p in trainer.model.named_parameters()}
    err = relative_error(got, unpacked_sgd_delta(tiny_llama("eager", vocab_size=len(tokenizer)), ids, labels))
    assert err <= 3e-4, err


@pytest.mark.parametrize(
    "overrides, match",
    [({"max_length": 1024}, "max_length=1024"), ({"packing": True}, "packing=True")],
)
def test_sft_refuses_packing_and_truncation(tmp_path, tokenizer, overrides, match):
    import balancer
    import balancer.hf

    topo = balancer.Topology(dp=1, cp=1, micro_batches=2, max_tokens=4096)
    with pytest.raises(ValueError, match=match):
        balancer.hf.BalancedSFTTrainer(
            model=tiny_llama(vocab_size=len(tokenizer)),
            args=_sft_config(tmp_path, **overrides),
            train_dataset=_prompt_completion(4),
            processing_class=tokenizer,
            topology=topo,
        )


def test_sft_defaults_from_max_length_and_eval(tmp_path, tokenizer):
    """No topology: max_length is the token budget (per_device_train_batch_size x max_length per micro-batch), TRL's
    truncation is off, and the eval loss over TRL-tokenized eval rows is the exact token-weighted completion loss."""
    import torch

    import attention
    import attention.hf
    import balancer.hf

    args = _sft_config(tmp_path, max_length=512, per_device_train_batch_size=2, eval_strategy="epoch")
    trainer = balancer.hf.BalancedSFTTrainer(
        model=tiny_llama(vocab_size=len(tokenizer)),
        args=args,
        train_dataset=_prompt_completion(8),
        eval_dataset=_prompt_completion(5),
        processing_class=tokenizer,
    )
    t = trainer.topology
    assert (t.dp, t.cp, t.micro_batches, t.max_tokens) == (1, 1, 1, 1024) and trainer.args.max_length is None
    trainer.train()
    metrics = trainer.evaluate()
    rows = [trainer.eval_dataset[i] for i in range(len(trainer.eval_dataset))]
    model = trainer.model
    total, count = 0.0, 0
    with torch.no_grad():  # the exact figure: every eval row alone, packed attention on one document
        for r in rows:
            ids, lab = torch.as_tensor(r["input_ids"]), torch.as_tensor(r["labels"])
            layout = attention.CPLayout.build([0, len(ids)], 1)
            with attention.hf.cp_context(layout, model=model):
                logits = model(input_ids=ids[None], position_ids=torch.arange(len(ids))[None]).logits[0, :-1]
            ce = torch.nn.functional.cross_entropy(logits.double(), lab[1:], ignore_index=-100, reduction="sum")
            total, count = total + float(ce), count + int((lab[1:] != -100).sum())
    assert metrics["eval_loss_tokens"] == count
    assert abs(metrics["eval_loss"] - total / count) <= 1e-5 * total / count
