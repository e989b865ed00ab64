"""Searching assignments with Optuna: strategies, samplers, seed noise, run directories."""
