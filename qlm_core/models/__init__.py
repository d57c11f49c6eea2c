from qlm_core.models.presets import load_model_spec
from qlm_core.models.spec import ModelSpec, RopeScaling, padded_vocab_size

__all__ = ["ModelSpec", "RopeScaling", "load_model_spec", "padded_vocab_size"]
