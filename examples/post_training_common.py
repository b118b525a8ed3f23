"""Shared by the post-training examples: a tokenizer trained on the spot and a tiny Llama of its vocabulary, saved
to a folder (no download), plus a small text corpus."""

from __future__ import annotations

import random
from pathlib import Path

WORDS = "the quick brown fox jumps over a lazy dog while long context attention balances every token".split()


def texts(n: int, seed: int, max_words: int = 12) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_words))) for _ in range(n)]


def tiny_model(folder: Path, eos_every: int = 0) -> Path:
    """Train a byte-level BPE tokenizer and save it with a 2-layer Llama of its vocabulary into `folder` (once).
    `eos_every`: also end generation on every `eos_every`-th token id (a random model rarely says EOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if (folder / "config.json").exists():
        return folder
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(texts(200, seed=0), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>")
    fast.save_pretrained(str(folder))
    config = LlamaConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                         pad_token_id=fast.pad_token_id)  # fmt: skip
    model = LlamaForCausalLM(config)
    if eos_every:
        model.generation_config.eos_token_id = [fast.eos_token_id, *range(eos_every, len(fast), eos_every)]
    model.save_pretrained(str(folder))
    return folder
