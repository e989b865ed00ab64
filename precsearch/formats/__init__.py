"""Float formats and their rounding, encoding and statistics kernels."""
