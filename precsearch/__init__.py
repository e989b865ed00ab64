"""precsearch: find mixed low-precision float assignments for training CNNs, and train under them."""

__version__ = "0.1.0"
