"""Secure aggregation (SecAgg+, Bell et al., CCS 2020): the server learns the sum of the
nodes' quantized updates, never one node's.

- :mod:`.quantize`: clip, stochastic rounding into Z_{2^b}, the no-wrap field size, decoding a sum;
- :mod:`.shamir`: t-of-n secret sharing over GF(2^521 - 1);
- :mod:`.crypto`: X25519, HKDF, AES-GCM and the AES-CTR mask generator;
- :mod:`.graph`: the k-regular random neighbour graph;
- :mod:`.client`, :mod:`.server`: the two halves as pure state machines, with
  :mod:`.messages` their stage messages and errors.

No Flower here: ``fedswarm.client.secagg_mod`` and ``fedswarm.server.secagg`` carry these
messages over Flower's Message API. ``docs/secagg.md`` has the protocol and its threat model.
"""

from fedswarm.algorithms.secagg.client import SecAggClient
from fedswarm.algorithms.secagg.graph import default_degree, neighbours
from fedswarm.algorithms.secagg.messages import (STAGES, Keys, MaskedInputRequest, SecAggError, SecAggFailed,
                                                 SecAggRefused, Setup, ShareKeysRequest, UnmaskReply,
                                                 UnmaskRequest)
from fedswarm.algorithms.secagg.quantize import DecodedSum, NoiseHook, Quantizer, field_bits, to_signed
from fedswarm.algorithms.secagg.server import RoundReport, SecAggParams, SecAggServer, threshold_for

__all__ = ["STAGES", "DecodedSum", "Keys", "MaskedInputRequest", "NoiseHook", "Quantizer", "RoundReport",
           "SecAggClient", "SecAggError", "SecAggFailed", "SecAggParams", "SecAggRefused", "SecAggServer", "Setup",
           "ShareKeysRequest", "UnmaskReply", "UnmaskRequest", "default_degree", "field_bits", "neighbours",
           "run_round", "threshold_for", "to_signed"]

from fedswarm.algorithms.secagg.simulate import run_round  # noqa: E402
