"""qlm's shared core: model, parallelism, checkpoints. The CLI in qlm_cli is a thin shell over it."""

__version__ = "0.1.0"
