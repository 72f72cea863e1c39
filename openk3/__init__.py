"""openk3: the reference open implementation of Kimi K3 in Python/PyTorch."""

from openk3.config import K3Config, preset

__all__ = ["K3Config", "preset"]
__version__ = "0.1.0"
