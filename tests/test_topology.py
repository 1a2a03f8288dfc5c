"""Topologies and mixing matrices, checked against closed forms and plain numpy."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedswarm.algorithms.decentralized.topology import (
    TOPOLOGIES,
    check_mixing,
    from_edges,
    make_topology,
    random_regular,
    spectral_gap,
)

STATIC_SPECS = ["ring", "torus", "torus:2x6", "torus:3x4", "exp", "complete", "random:3",
                "random:4", "random:2", "ring+lazy"]


def _numpy_mh(n: int, edges: list[tuple[int, int]]) -> np.ndarray:
    """Independent Metropolis–Hastings weights from an edge list."""
    adj = np.zeros((n, n), dtype=bool)
    for i, j in edges:
        adj[i, j] = adj[j, i] = True
    deg = adj.sum(1)
    W = np.zeros((n, n))
    for i in range(n):
        for j in range(n):
            if adj[i, j]:
                W[i, j] = 1.0 / (1 + max(deg[i], deg[j]))
        W[i, i] = 1.0 - W[i].sum()
    return W


@pytest.mark.parametrize("spec", STATIC_SPECS)
@pytest.mark.parametrize("n", [12])
def test_static_mixing_is_symmetric_doubly_stochastic(spec, n):
    topo = make_topology(spec, n, seed=1)
    W = topo.mixing_matrix()
    assert W.dtype == torch.float64 and W.shape == (n, n)
    check_mixing(W)
    Wn = W.numpy()
    np.testing.assert_allclose(Wn, Wn.T, atol=1e-12)
    np.testing.assert_allclose(Wn.sum(0), 1.0, atol=1e-12)
    np.testing.assert_allclose(Wn.sum(1), 1.0, atol=1e-12)
    assert (Wn >= 0).all()
    assert topo.is_connected()
    # support of W is exactly the graph plus the diagonal
    A = topo.adjacency().numpy()
    assert ((Wn > 0) == (A | np.eye(n, dtype=bool))).all()


@pytest.mark.parametrize("n", [5, 8, 12, 16])
def test_time_varying_mixing_at_several_rounds(n):
    topo = make_topology("onepeer-exp", n)
    assert topo.time_varying and topo.period == math.ceil(math.log2(n))
    for t in range(3 * topo.period + 1):
        W = topo.mixing_matrix(t)
        check_mixing(W)
        hop = 2 ** (t % topo.period)
        for i in range(n):
            assert set(topo.neighbors(i, t)) == {(i + hop) % n, (i - hop) % n} - {i}
    # the graph changes between rounds
    assert not torch.equal(topo.mixing_matrix(0), topo.mixing_matrix(1))


@pytest.mark.parametrize("spec", ["ring", "exp", "torus:3x4", "random:3", "complete"])
def test_weights_match_numpy_metropolis_hastings(spec):
    topo = make_topology(spec, 12, seed=3)
    np.testing.assert_allclose(topo.mixing_matrix().numpy(), _numpy_mh(12, topo.edges()), atol=1e-12)


def test_metropolis_hastings_on_irregular_graph():
    # a star plus a tail: degrees differ, so weights are not uniform
    edges = [(0, 1), (0, 2), (0, 3), (3, 4)]
    topo = from_edges(5, edges)
    W = topo.mixing_matrix()
    check_mixing(W)
    np.testing.assert_allclose(W.numpy(), _numpy_mh(5, edges), atol=1e-12)
    assert W[0, 1] == pytest.approx(1 / 4) and W[3, 4] == pytest.approx(1 / 3)


def test_regular_graph_weights_are_uniform():
    for spec in ["ring", "exp", "torus:4x4", "random:5"]:
        topo = make_topology(spec, 16, seed=2)
        W = topo.mixing_matrix()
        deg = topo.degrees()
        assert (deg == deg[0]).all()
        nz = W[W > 0]
        np.testing.assert_allclose(nz.numpy(), 1.0 / (int(deg[0]) + 1), atol=1e-12)


def test_spectral_gap_complete_is_one():
    for n in [2, 5, 16]:
        assert make_topology("complete", n).spectral_gap() == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("n", [3, 4, 5, 8, 11, 16, 33])
def test_spectral_gap_ring_closed_form(n):
    expected = 1 - (1 + 2 * math.cos(2 * math.pi / n)) / 3
    assert make_topology("ring", n).spectral_gap() == pytest.approx(expected, abs=1e-12)


def test_spectral_gap_of_disconnected_round_is_zero():
    topo = make_topology("onepeer-exp", 8)
    assert topo.spectral_gap(0) > 0  # distance 1: a ring
    assert topo.spectral_gap(1) == pytest.approx(0.0, abs=1e-12)  # distance 2: two 4-cycles


def test_lazy_has_nonnegative_spectrum():
    W = make_topology("ring+lazy", 8).mixing_matrix()
    check_mixing(W)
    assert torch.linalg.eigvalsh(W).min() >= -1e-12
    assert torch.linalg.eigvalsh(make_topology("ring", 8).mixing_matrix()).min() == pytest.approx(-1 / 3)


def test_shapes_of_named_graphs():
    assert (make_topology("torus:4x5", 20).degrees() == 4).all()
    assert make_topology("torus", 12).name == "torus:3x4"
    assert (make_topology("exp", 16).degrees() == 7).all()  # ±1, ±2, ±4, 8
    assert make_topology("exp", 16).neighbors(0) == [1, 2, 4, 8, 12, 14, 15]
    assert (make_topology("complete", 6).degrees() == 5).all()
    assert make_topology("ring", 6).neighbors(0) == [1, 5]


def test_random_regular_is_seeded_regular_and_connected():
    a = random_regular(20, 4, seed=7)
    b = random_regular(20, 4, seed=7)
    c = random_regular(20, 4, seed=8)
    assert (a.degrees() == 4).all() and a.is_connected()
    assert torch.equal(a.adjacency(), b.adjacency())
    assert not torch.equal(a.adjacency(), c.adjacency())
    assert (random_regular(30, 2, seed=1).degrees() == 2).all()


def test_edge_list_file(tmp_path):
    p = tmp_path / "g.txt"
    p.write_text("# a path graph\n0 1\n1,2\n\n2 3  # tail\n")
    topo = make_topology(f"edges:{p}", 4)
    assert topo.edges() == [(0, 1), (1, 2), (2, 3)]
    check_mixing(topo.mixing_matrix())
    j = tmp_path / "g.json"
    j.write_text("[[0, 1], [1, 2], [2, 0]]")
    assert make_topology(f"edges:{j}", 3).edges() == [(0, 1), (0, 2), (1, 2)]


def test_edge_list_refusals(tmp_path):
    with pytest.raises(ValueError, match=r"disconnected: node\(s\) 2, 3 unreachable"):
        from_edges(4, [(0, 1), (2, 3)])
    with pytest.raises(ValueError, match="self loop"):
        from_edges(3, [(0, 1), (1, 1), (1, 2)])
    with pytest.raises(ValueError, match="outside 0..2"):
        from_edges(3, [(0, 1), (1, 3)])
    with pytest.raises(ValueError, match="does not exist"):
        make_topology(f"edges:{tmp_path / 'nope.txt'}", 3)
    bad = tmp_path / "bad.txt"
    bad.write_text("0 1 2\n")
    with pytest.raises(ValueError, match=r"bad.txt:1: expected 'i j'"):
        make_topology(f"edges:{bad}", 3)


@pytest.mark.parametrize(
    "spec, n, message",
    [
        ("star", 4, r"unknown topology 'star' \(available: ring, torus"),
        ("ring:3", 4, "takes no argument"),
        ("torus:3x4", 10, r"torus:3x4 has 12 nodes but n=10"),
        ("torus:3by4", 12, "torus:RxC"),
        ("torus", 7, "no factorization"),
        ("random", 8, "random:D"),
        ("random:3", 5, "n\\*D even"),
        ("random:5", 5, "D < n"),
        ("random:1", 6, "disconnected"),
        ("edges", 4, "edges:PATH"),
        ("ring", 0, "n >= 1"),
    ],
)
def test_bad_specs_are_refused_clearly(spec, n, message):
    with pytest.raises(ValueError, match=message):
        make_topology(spec, n)


def test_check_mixing_names_what_fails():
    with pytest.raises(ValueError, match="square"):
        check_mixing(torch.ones(2, 3) / 3)
    with pytest.raises(ValueError, match="not symmetric"):
        check_mixing(torch.eye(3, dtype=torch.float64)[[1, 2, 0]])  # a 3-cycle permutation
    with pytest.raises(ValueError, match="nonnegative"):
        check_mixing(torch.tensor([[1.5, -0.5], [-0.5, 1.5]], dtype=torch.float64))
    with pytest.raises(ValueError, match="row 0 sums to 0.9"):
        check_mixing(torch.tensor([[0.4, 0.5], [0.5, 0.5]], dtype=torch.float64))
    check_mixing(torch.full((3, 3), 1 / 3, dtype=torch.float64))


def test_node_weights_row_and_registry():
    topo = make_topology("ring", 5)
    w = topo.weights(0)
    assert set(w) == {0, 1, 4} and sum(w.values()) == pytest.approx(1.0)
    assert set(TOPOLOGIES) == {"ring", "torus", "exp", "onepeer-exp", "complete", "random", "edges"}
    for name, (ctor, desc) in TOPOLOGIES.items():
        assert callable(ctor) and desc.startswith(name)


def test_spectral_gap_function_matches_numpy():
    W = make_topology("random:3", 10, seed=4).mixing_matrix()
    ev = np.sort(np.abs(np.linalg.eigvalsh(W.numpy())))[::-1]
    assert spectral_gap(W) == pytest.approx(1 - ev[1], abs=1e-12)
