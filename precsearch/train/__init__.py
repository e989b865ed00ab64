"""Data, the training loop, proxies and data-parallel training."""
