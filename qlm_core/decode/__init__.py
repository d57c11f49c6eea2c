"""Decoding, below `train` and `eval` so that both may use it: the model of a checkpoint, KV-cache sampling,
prompts and stops."""
