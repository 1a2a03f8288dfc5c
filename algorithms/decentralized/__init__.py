"""Decentralized (gossip) algorithms: one object per algorithm, and the topologies they
gossip over. No global model: node ``i``'s model is row ``i`` of ``x [n, d]``.

Every algorithm has three steps shared by all runtimes: a local step, what a node sends,
and how a node mixes what it received (:mod:`.base`)::

    algo = make_algorithm("d2")
    topo = make_topology("ring", 5)      # fedswarm.algorithms.decentralized.topology
    state = algo.init_state(x0)          # x0: [n, d]
    algo.local_step(state, grads, lr)
    algo.mix(state, algo.message(state), topo.mixing_matrix(t))

:mod:`.catalog` names every algorithm with its hyperparameters (:data:`ALGORITHMS`).
"""

from fedswarm.algorithms.decentralized import catalog as _catalog
from fedswarm.algorithms.decentralized.catalog import *  # noqa: F403  (the catalog's public names)

__all__ = list(_catalog.__all__)
