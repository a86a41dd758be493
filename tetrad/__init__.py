"""Tetrad: a Kubernetes-native operator bundle for 4D-parallel PyTorch training.

The `tetrad` package is the shared core. It imports neither torch nor kopf at module import.
"""

__version__ = "0.1.0"
