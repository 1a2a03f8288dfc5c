"""Corrupt Shamir shares at unmasking: the server checks every rebuilt secret against what its
owner advertised at stage 0 (a mask key against its public key, a self-mask seed against its
commitment), tries other t-subsets of the shares, names the corrupt ones, and fails the round
cleanly when no subset rebuilds the advertised secret. The oracle for the sums is the same as
test_secagg_protocol's: the survivors' encoded inputs summed as Python ints mod 2^b."""

from __future__ import annotations

import secrets

import numpy as np
import pytest

from fedswarm.algorithms.secagg import SecAggClient, SecAggFailed, SecAggParams, SecAggServer, run_round, shamir
from fedswarm.algorithms.secagg.client import seed_commitment

IDS = [11, 23, 35, 47, 59, 61, 73, 85]
PARAMS = SecAggParams(threshold=0.6, clip=1.0, bits=32)


def _flip(share: bytes) -> bytes:
    """Another field element: the share's last bit flipped (two such errors can cancel at 0)."""
    return share[:-1] + bytes([share[-1] ^ 1])


def _junk(share: bytes) -> bytes:
    """A uniformly random field element in place of the share."""
    return secrets.randbelow(shamir.PRIME).to_bytes(shamir.SHARE_BYTES, "big")


class CorruptHolder(SecAggClient):
    """A node that answers the unmask stage with its share of ``owner``'s secret corrupted by ``how``."""

    def __init__(self, node_id: int, owner: int, how=_flip):
        super().__init__(node_id)
        self.owner, self.how = owner, how

    def unmask(self, req):
        out = super().unmask(req)
        for shares in (out.seed_shares, out.key_shares):
            if self.owner in shares:
                shares[self.owner] = self.how(shares[self.owner])
        return out


def _round(corrupt: dict[int, int], dropped: set[int] = frozenset(), how=_flip):
    """One round over IDS where node h corrupts (``how``) its share of node corrupt[h]'s secret."""
    rng = np.random.default_rng(0)
    ups = {i: rng.normal(0.0, 0.4, 200) for i in IDS}
    clients = [CorruptHolder(i, corrupt[i], how) if i in corrupt else SecAggClient(i) for i in IDS]
    return run_round(ups, PARAMS, clients=clients, drop={"masked_input": set(dropped)}, graph_seed=3)


def _exact(res):
    acc = [0] * (200 + 1)
    for v in res.encoded.values():
        acc = [a + int(x) for a, x in zip(acc, v, strict=True)]
    return np.array([a % (1 << 32) for a in acc], dtype=np.uint64)


def test_recover_names_the_corrupt_shares_and_rebuilds_the_secret():
    secret, xs = secrets.token_bytes(32), [3, 5, 8, 13, 21, 34, 55]
    shares = list(zip(xs, shamir.split(secret, xs, 4), strict=True))
    shares[0] = (3, _flip(shares[0][1]))  # in the first 4-subset tried
    shares[4] = (21, _flip(shares[4][1]))
    got, bad = shamir.recover(shares, 4, lambda s: s == secret)
    assert got == secret and sorted(bad) == [3, 21]
    clean, none = shamir.recover(list(zip(xs, shamir.split(secret, xs, 4), strict=True)), 4, lambda s: s == secret)
    assert clean == secret and none == []


def test_recover_fails_when_no_subset_is_clean():
    secret, xs = secrets.token_bytes(32), [1, 2, 3, 4, 5]
    shares = [(x, _junk(y) if x <= 3 else y) for x, y in zip(xs, shamir.split(secret, xs, 3), strict=True)]
    with pytest.raises(ValueError, match="none of the 10 of 10 3-subsets"):
        shamir.recover(shares, 3, lambda s: s == secret)


def test_a_corrupt_mask_key_share_of_a_dropped_node_is_caught_and_the_sum_stays_exact():
    res = _round({IDS[0]: 47}, dropped={47})  # node 11's share of node 47's mask key is wrong
    np.testing.assert_array_equal(res.total, _exact(res))
    assert res.report.recovered == 1 and res.report.bad_shares == ["11>47:key"]


def test_a_corrupt_self_mask_seed_share_is_caught_and_the_sum_stays_exact():
    res = _round({IDS[0]: 59, IDS[1]: 59})  # two of node 59's seed shares are wrong
    np.testing.assert_array_equal(res.total, _exact(res))
    assert sorted(res.report.bad_shares) == ["11>59:seed", "23>59:seed"]


def test_too_many_corrupt_shares_fail_the_round_naming_the_owner():
    t = SecAggServer(IDS, 200, PARAMS).threshold
    holders = [i for i in IDS if i != 59][: len(IDS) - t + 1]  # fewer than t clean shares of 59's seed remain
    with pytest.raises(SecAggFailed, match="node 59's self-mask seed does not reconstruct to what it advertised") as e:
        _round(dict.fromkeys(holders, 59), how=_junk)  # (one-bit flips can cancel at 0: the secret comes back right)
    assert e.value.stage == "unmask"


def test_the_commitment_binds_round_node_and_seed():
    seed = secrets.token_bytes(32)
    c = seed_commitment(b"r" * 16, 7, seed)
    assert len(c) == 32
    assert c != seed_commitment(b"s" * 16, 7, seed) and c != seed_commitment(b"r" * 16, 8, seed)
    assert c != seed_commitment(b"r" * 16, 7, secrets.token_bytes(32))


def test_an_advertisement_without_a_seed_commitment_is_left_out():
    srv = SecAggServer(IDS, 10, PARAMS)
    keys = {i: SecAggClient(i).advertise(srv.setup()[i]) for i in IDS}
    keys[23] = type(keys[23])(keys[23].c_public, keys[23].s_public)  # no commitment
    assert 23 not in srv.collect_keys(keys) and srv.report.advertised == len(IDS) - 1
