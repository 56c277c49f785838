"""The PyTorch / transformers engine."""
