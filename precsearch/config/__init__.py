"""Torch-free data: the shared vocabulary, the policy file and the search space."""
