"""The Hugging Face trainers built on the sampler core, streams and measured balance: `BalancedTrainer` (trainer.py),
`BalancedSFTTrainer` (sft.py), their evaluation (eval.py), the default topology from `TrainingArguments`
(defaults.py), a streaming `train_dataset` (stream.py) and `balance_mode=` (balance.py). Imported through
`balancer.hf`, which keeps `import balancer` free of transformers and TRL.
"""
