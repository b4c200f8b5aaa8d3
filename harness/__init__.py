"""lowp: a Hydra-driven experiment harness for low-precision transformer training."""

__version__ = "0.1.0"
