"""Shamir t-of-n secret sharing of 32-byte secrets over the prime field GF(2^521 - 1).

A secret of up to 64 bytes is one field element (the Mersenne prime 2^521 - 1 exceeds 2^512),
so a 32-byte key or seed is shared whole, with no chunking. A polynomial of degree ``t - 1``
with the secret as its constant term and random coefficients (``secrets`` module) is
evaluated at the share holders' x-coordinates (distinct, non-zero); any ``t`` shares give the
secret back by Lagrange interpolation at 0, fewer give no information about it. A share is
its x-coordinate and its 66-byte y, big-endian.
"""

from __future__ import annotations

import itertools
import math
import secrets
from collections.abc import Callable, Iterable, Sequence

__all__ = ["PRIME", "SHARE_BYTES", "combine", "recover", "split"]

#: The field's modulus: the Mersenne prime 2^521 - 1.
PRIME = (1 << 521) - 1
#: Bytes of a share's y value.
SHARE_BYTES = 66
_SECRET_MAX = 64


def _coefficients(count: int, coeff_key: bytes | None) -> list[int]:
    """``count`` uniform elements of the field: from the OS, or (``coeff_key``, 32 secret bytes)
    from AES-256-CTR under that key, 80 bytes each (bias below 2^-110), so that sharing the same
    secret again with the same key gives the same shares."""
    if coeff_key is None:
        return [secrets.randbelow(PRIME) for _ in range(count)]
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    stream = Cipher(algorithms.AES(coeff_key), modes.CTR(b"\0" * 16)).encryptor().update(bytes(80 * count))
    return [int.from_bytes(stream[80 * i:80 * (i + 1)], "big") % PRIME for i in range(count)]


def split(secret: bytes, xs: Sequence[int], threshold: int, coeff_key: bytes | None = None) -> list[bytes]:
    """Shares of ``secret`` for holders at ``xs`` (one share each, in that order): any
    ``threshold`` of them recover it, fewer reveal nothing. ``coeff_key`` (32 secret bytes)
    makes the random polynomial a function of that key: the same call gives the same shares."""
    if not 0 < len(secret) <= _SECRET_MAX:
        raise ValueError(f"shamir: a secret has 1..{_SECRET_MAX} bytes, got {len(secret)}")
    if len(set(xs)) != len(xs) or any(not 0 < x < PRIME for x in xs):
        raise ValueError("shamir: share x-coordinates must be distinct and non-zero")
    if not 1 <= threshold <= len(xs):
        raise ValueError(f"shamir: threshold must be in [1, {len(xs)}] (the number of holders), got {threshold}")
    # The length travels with the secret so a secret with leading zero bytes comes back whole.
    coeffs = [int.from_bytes(bytes([len(secret)]) + secret, "big")]
    coeffs += _coefficients(threshold - 1, coeff_key)
    out = []
    for x in xs:
        y = 0
        for c in reversed(coeffs):
            y = (y * x + c) % PRIME
        out.append(y.to_bytes(SHARE_BYTES, "big"))
    return out


def _interpolate(pts: Sequence[tuple[int, int]], at: int) -> int:
    """The value at ``at`` of the polynomial of degree ``len(pts) - 1`` through ``pts`` (Lagrange)."""
    xs = [x for x, _ in pts]
    value = 0
    for i, (xi, yi) in enumerate(pts):
        num, den = 1, 1
        for j, xj in enumerate(xs):
            if j != i:
                num = num * (at - xj) % PRIME
                den = den * (xi - xj) % PRIME
        value = (value + yi * num * pow(den, -1, PRIME)) % PRIME
    return value


def _points(shares: Iterable[tuple[int, bytes]]) -> list[tuple[int, int]]:
    pts = [(int(x), int.from_bytes(y, "big")) for x, y in shares]
    xs = [x for x, _ in pts]
    if not pts or len(set(xs)) != len(xs):
        raise ValueError("shamir: combine needs shares with distinct x-coordinates")
    return pts


def _decode(value: int) -> bytes:
    raw = value.to_bytes(SHARE_BYTES, "big").lstrip(b"\0")
    if not raw or raw[0] != len(raw) - 1:
        raise ValueError("shamir: the shares do not reconstruct a secret (too few shares, or corrupt ones)")
    return raw[1:]


def combine(shares: Iterable[tuple[int, bytes]]) -> bytes:
    """The secret from ``(x, share)`` pairs: at least the threshold many, else the result is garbage
    (or a clear error when it does not decode)."""
    return _decode(_interpolate(_points(shares), 0))


#: :func:`recover` tries at most this many ``threshold``-subsets of the shares.
MAX_SUBSETS = 256


def recover(shares: Sequence[tuple[int, bytes]], threshold: int, verify: Callable[[bytes], bool],
            max_subsets: int = MAX_SUBSETS) -> tuple[bytes, list[int]]:
    """The secret that ``verify`` accepts, rebuilt from some ``threshold`` of ``shares``, and the
    x-coordinates of the shares that are not on its polynomial (corrupt ones). Tries the
    ``threshold``-subsets in order, at most ``max_subsets`` of them: with ``e`` corrupt shares
    among ``m``, some subset is clean when ``m - e >= threshold``. Corrupt shares can cancel at 0
    (the secret comes out right from a wrong polynomial), so the shares named are those off the
    polynomial, among the accepted subsets', that the most shares lie on; the search stops at one
    that all shares lie on. Raises ValueError when no subset tried rebuilds a secret ``verify``
    accepts."""
    pts = _points(shares)
    if len(pts) < threshold:
        raise ValueError(f"shamir: {len(pts)} shares, fewer than the threshold {threshold}")
    best: tuple[bytes, list[int]] | None = None
    tried = 0
    for subset in itertools.islice(itertools.combinations(pts, threshold), max_subsets):
        tried += 1
        try:
            secret = _decode(_interpolate(subset, 0))
        except ValueError:
            continue
        if (best is not None and secret != best[0]) or not verify(secret):
            continue
        inside = {x for x, _ in subset}
        bad = [x for x, y in pts if x not in inside and _interpolate(subset, x) != y]
        if best is None or len(bad) < len(best[1]):
            best = secret, bad
        if not bad:
            break
    if best is None:
        raise ValueError(f"shamir: none of the {tried} of {math.comb(len(pts), threshold)} {threshold}-subsets of "
                         f"the {len(pts)} shares rebuilds the secret its owner committed to (too many corrupt shares)")
    return best
