"""Reports, proxy fidelity and predicted-vs-measured checks."""
