"""Who trains what: Homogeneous Learning's node-selection policy, PVT's variable subsets
and ProgFed's stage schedule. Pure functions and small state objects; the Flower
strategies that use them live in ``fedswarm.strategies.edge``."""
