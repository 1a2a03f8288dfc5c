"""A compressed strategy's checkpoint deep-copies its replica bookkeeping (ReplicaSync). In a
deployment, a round in which every node failed left the bodies planned for that round in its
cache, holding the buffers Flower had sent (memoryviews), and the ServerApp's checkpoint died
with "cannot pickle memoryview objects". The cache is not state: a copy leaves it out."""

import copy

import torch
from flwr.app import RecordDict

from fedswarm.strategies.federated.compressed_sync import ReplicaSync


def test_a_copy_leaves_the_body_cache_out_and_writes_the_same_bodies():
    sync = ReplicaSync()
    sync.reset(torch.arange(6, dtype=torch.float32))
    sent = RecordDict()
    sync.write(sent, node_id=7)
    assert sync._bodies
    base = next(iter(sync._bodies))
    mode, records = sync._bodies[base]
    sync._bodies[base] = (mode, {**records, "sent-buffer": memoryview(b"abc")})  # what a deployment's cache holds
    twin = copy.deepcopy(sync)  # raised TypeError: cannot pickle 'memoryview' object
    assert twin._bodies == {} and sync._bodies  # the original keeps its cache
    assert twin.version == sync.version and torch.equal(twin.x, sync.x) and twin.nodes == sync.nodes
    again = RecordDict()
    twin.write(again, node_id=8)
    assert set(again.keys()) == set(sent.keys())
