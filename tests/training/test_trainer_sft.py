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
