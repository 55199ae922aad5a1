"""Reusable model components in plain PyTorch (nanoGPT style): masks, attention, blocks, tiny LMs."""
