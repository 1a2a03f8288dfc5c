"""Byzantine robustness: aggregation rules on the client axis (median, trimmed mean, Krum,
Multi-Krum, Bulyan, majority-vote signSGD), the gradient codes that decode an exact sum
despite liars (Draco's repetition code, a Solon-style polynomial code), and the attacks
used to test them. Torch and numpy only."""
