"""Training: the step engine (engine.py); the loop, checkpoints and metrics build on it."""
