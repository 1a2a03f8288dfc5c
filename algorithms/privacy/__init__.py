"""Differential privacy: client-level DP-FedAvg (clipping, Gaussian noise, adaptive
clipping), example-level DP-SGD, and the privacy accountant (Google's dp-accounting)."""
