"""Data on disk: input readers, tokenizers, the pretokenize pipeline, shard folders and length traces."""
