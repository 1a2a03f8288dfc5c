"""Fuzz tests of node state snapshots and checkpoints (targets: tests/fuzzing):
FEDSWARM_FUZZ_CASES cases a parser (default 2,000, reproducible), and every saved example in
tests/fuzz_corpus replayed."""

from tests.fuzzing import make_tests

test_fuzz, test_replay_corpus = make_tests(['state_file', 'peer_checkpoint', 'server_checkpoint'])
