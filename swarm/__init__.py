"""The peer-to-peer runtime: training with no server.

==============  ==================================================================
net.identity    Ed25519 key pairs, allow lists, the pairwise X25519 secret
net.envelope    signed message format; drops (forged, replayed, ...) by reason
net.transport   TCP (optional TLS) sessions, chunked bodies, timeouts, byte counts
net.payload     model / codec payloads and their validation
net.membership  gossip of member lists, heartbeat failure detection, the topology
net.inbox       per-round messages, waited on with a timeout
drivers         each algorithm's round over sockets (gossip objects, Swarm
                Learning merge, Leader SGD); adpsgd, squarm: the other two.
                Drivers only route: the math is fedswarm.algorithms.decentralized
checkpoint      atomic per-round checkpoints
peer            the peer process: composition of the above, the round loop
report          heartbeats and rounds to a dashboard or a run store
launcher, cli   ``fedswarm peer``, ``fedswarm swarm``, ``fedswarm keys``
==============  ==================================================================

A peer needs only the core dependencies (torch, numpy, cryptography; no Ray, no
scikit-learn except through the chosen task, no web stack), so a Raspberry Pi runs one.
flwr is not imported at all: the algorithms a peer drives (``fedswarm.algorithms``) are
Flower-free.
"""
