"""Training under a policy: rounding, packed saved tensors, loss scaling, low-precision updates."""
