"""Fuzz tests of the dashboard's ingest API (see tests/fuzzing): FEDSWARM_FUZZ_CASES
cases per parser (default 2,000, reproducible), and every saved example in tests/fuzz_corpus replayed."""

from __future__ import annotations

import pytest

from tests.fuzzing import corpus_files, get_target, run_cases

NAMES = ['ingest']


@pytest.mark.timeout(900)  # ~10-20 s on a quiet core; a loaded one may take many times that
@pytest.mark.parametrize("name", NAMES)
def test_fuzz(name):
    target = get_target(name)
    outcomes = run_cases(target)
    # the inputs reach past the first check: some are accepted, and several distinct refusals happen
    assert outcomes["accepted"] > 0, outcomes
    assert len(outcomes) >= target.min_outcomes, outcomes


@pytest.mark.parametrize("path", [p for n in NAMES for p in corpus_files(n)], ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_replay_corpus(path):
    get_target(path.parent.name).run(path.read_bytes())
