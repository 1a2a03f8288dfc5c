"""fedswarm: federated and decentralized learning on Flower and PyTorch."""

__version__ = "0.1.0"
