"""Strategies for weak and heterogeneous devices: partial-variable training (PVT),
progressive training (ProgFed) and learned sequential node selection (HL)."""
