"""Tracing a model into a TensorGraph of every tensor training keeps, and the paper's groups."""
