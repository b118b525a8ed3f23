"""The Hugging Face trainers built on the sampler core, streams and measured balance: `BalancedTrainer` (trainer.py),
`BalancedSFTTrainer` (sft.py), their evaluation (eval.py), the default topology from `TrainingArguments` (defaults.py),
a streaming `train_dataset` (stream.py), `balance_mode=` (balance.py) and the logged loss's mean over the processes
(loss_log.py: `process_mean`, also the TRL trainers'). Imported through `balancer.hf`, which keeps `import balancer`
free of transformers and TRL.
"""
