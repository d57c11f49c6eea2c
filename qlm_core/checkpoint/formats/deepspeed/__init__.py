"""DeepSpeed checkpoints: reading ZeRO 0-3 module weights and fp32 masters (checkpoint.py), the HF config beside
them (config.py), and writing one (write.py)."""
