"""Hugging Face models: safetensors / .bin weights with config.json and the tokenizer (checkpoint.py), the tokens
config.json and generation_config.json carry (tokens.py), and PEFT adapters (peft.py)."""
