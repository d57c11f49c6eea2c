"""Numerical building blocks. Torch-native first; fused CUDA kernels (flash-attn, apex) are used only when installed."""
