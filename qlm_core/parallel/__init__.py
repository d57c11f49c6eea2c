"""Hybrid parallelism: every parallel layer is a plain layer when its process group has size 1 (or is None)."""
