from qlm_core.models.spec import ModelSpec, RopeScaling, load_model_spec, padded_vocab_size

__all__ = ["ModelSpec", "RopeScaling", "load_model_spec", "padded_vocab_size"]
