"""Federated strategies with a server model: FedAvg and the compressed ones (compressed
FedAvg, 1-bit SGD, global top-k, the Count-Sketch methods) with their client halves."""
