"""Fuzz tests of codec payloads, model replies and PVT replies from Flower clients (targets: tests/fuzzing):
FEDSWARM_FUZZ_CASES cases a parser (default 2,000, reproducible), and every saved example in
tests/fuzz_corpus replayed."""

from tests.fuzzing import make_tests

test_fuzz, test_replay_corpus = make_tests(['flower_reply'])
