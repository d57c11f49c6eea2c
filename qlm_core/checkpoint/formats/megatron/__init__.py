"""Megatron-LM / Megatron-Core checkpoints: the legacy `torch` rank files (legacy.py, legacy_stream.py), the
`torch_dist` DCP layout (torch_dist*.py), the `args` they store (args.py, lora_args.py, trainer_state.py), Megatron-
Bridge's run_config.yaml (bridge_config.py), and opening either format with the architecture from elsewhere
(format.py, configured.py, open_configured*.py)."""
