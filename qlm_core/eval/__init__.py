"""Evaluation: lm-evaluation-harness over qlm's own model (the `qlm` backend) or over lm-eval's `hf` backend."""
