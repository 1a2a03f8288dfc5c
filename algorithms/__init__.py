"""fedswarm's algorithms: the math, once, on a leading client axis.

Torch and numpy only: no Flower, no sockets, no store. Three runtimes drive these objects
(Flower strategies in ``fedswarm.strategies``, the simulator engines in ``fedswarm.sim``,
the swarm peers in ``fedswarm.swarm``), so each algorithm's math lives here and nowhere
else.

- :mod:`fedswarm.algorithms.compression`: codecs, their kernels, the count sketch and the
  error-feedback memory;
- :mod:`fedswarm.algorithms.decentralized`: one object per decentralized algorithm, and
  the topologies they gossip over;
- :mod:`fedswarm.algorithms.selection`: what a node trains or who trains next (HL's
  policy, PVT's and ProgFed's schedules).
"""
