"""The data layer: Megatron indexed datasets, tokenisation, pretraining and SFT samples, global batches.

Floor rule: modules here import only qlm_core.errors and each other."""
