"""The balanced trainers refuse hostile options when built, one line naming the argument: balance_mode, cp_method,
attention_backend, filler_rows and seed given a wrong type, NaN, an infinity, a negative number, zero or a bool (old:
cp_method, attention_backend and filler_rows took anything; a misspelt cp_method surfaced at the first CP attention
call, and never without CP)."""

from __future__ import annotations

import math

import pytest
from support.data_files import make_texts, train_hf_tokenizer
from support.trainer import PLAIN_SGD, tiny_llama, token_rows, training_args

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
pytestmark = pytest.mark.slow  # builds transformers Trainers

import balancer  # noqa: E402

TOPO = balancer.Topology(dp=1, micro_batches=2, max_tokens=160, tokens_per_step=300)
HOSTILE = [math.nan, math.inf, -1, 0, True, "rign", None]
CASES = [
    ("balance_mode", [math.nan, math.inf, -1, 0, True, "always", ["shadow"]]),
    ("cp_method", HOSTILE),
    ("attention_backend", HOSTILE),
    ("filler_rows", [math.nan, math.inf, -1, 0, 1, "yes", None]),
    ("seed", [math.nan, math.inf, -1, 1.5, True, "1"]),
]


@pytest.fixture(scope="module")
def built():
    import balancer.hf

    ds = datasets.Dataset.from_dict({"input_ids": token_rows(40, seed=3, max_len=60)})
    model = tiny_llama()

    def build(out, **kw):
        return balancer.hf.BalancedTrainer(model=model, args=training_args(out), train_dataset=ds, topology=TOPO, **kw)

    return build


@pytest.mark.parametrize("name, values", CASES, ids=[c[0] for c in CASES])
def test_balanced_trainer_options(tmp_path, built, name, values):
    for value in values:
        with pytest.raises(ValueError) as err:
            built(str(tmp_path), **{name: value})
        text = str(err.value)
        assert name in text and "\n" not in text, (value, text)
    built(str(tmp_path), cp_method="allgather", attention_backend="torch", filler_rows=True, balance_mode="off")


def test_balanced_sft_trainer_options(tmp_path):
    pytest.importorskip("trl")
    from transformers import AutoTokenizer
    from trl import SFTConfig

    import balancer.hf

    tok = AutoTokenizer.from_pretrained(
        str(train_hf_tokenizer(tmp_path / "tok", make_texts(40, seed=3), vocab_size=300))
    )
    texts = make_texts(8, seed=4, max_words=12)
    ds = datasets.Dataset.from_dict({"prompt": texts[:4], "completion": texts[4:]})
    topo = balancer.Topology(dp=1, micro_batches=2, max_tokens=4096)
    args = SFTConfig(output_dir=str(tmp_path / "out"), **{**PLAIN_SGD, "max_length": None, "bf16": False})
    for name, value in [("cp_method", "rign"), ("attention_backend", math.nan), ("balance_mode", 0), ("seed", -1)]:
        with pytest.raises(ValueError) as err:
            balancer.hf.BalancedSFTTrainer(
                model=tiny_llama(vocab_size=len(tok)), args=args, train_dataset=ds, processing_class=tok,
                topology=topo, **{name: value},
            )  # fmt: skip
        assert name in str(err.value) and "\n" not in str(err.value), (name, str(err.value))
