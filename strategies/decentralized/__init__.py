"""Decentralized algorithms on Flower: a strategy that only routes messages along the
topology (:mod:`.router`) and the node half that runs the algorithm object (:mod:`.node`)."""
