"""Training-loop integration: the balanced sampler, the packed collator and loss normalisation."""
