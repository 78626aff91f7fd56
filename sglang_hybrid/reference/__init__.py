"""Pure-PyTorch golden implementation of the hybrid family and its reference ops."""

from sglang_hybrid.reference.model import GoldenModel, load

__all__ = ["GoldenModel", "load"]
