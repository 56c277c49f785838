"""The PyTorch / transformers engine: ``engine.TorchEngine`` on ``runner.TorchRunner``."""

__all__ = ["engine", "runner"]
