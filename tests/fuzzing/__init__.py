"""Fuzz targets: every parser of untrusted bytes, with the refusals it is allowed to make.

A :class:`Target` pairs a Hypothesis strategy that draws *inputs as bytes* (structure-aware:
a valid message, file or body, then one or more fields mutated, truncated, oversized,
reordered or duplicated) with ``run(data)``, which feeds the bytes to the real parser and
returns ``"accepted"`` or ``"refused:<reason>"`` when the parser refused them with one of its
known errors. Anything else -- another exception, a broken invariant of an accepted input
(a non-finite value reaching a model, a body longer than the limit, an allocation larger
than a limit allows) -- propagates and is a defect.

Inputs are bytes so a failing one can be kept as a file: ``tests/fuzz_corpus/<target>/`` holds
every defect found so far (``scripts/fuzz`` writes them) and ``tests/test_fuzz_*.py`` replay
each one on every run. ``FEDSWARM_FUZZ_CASES`` sets the cases per target (default 2,000).
"""

from __future__ import annotations

import hashlib
import importlib
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import seed as with_seed
from hypothesis import strategies as st

__all__ = ["CORPUS", "TARGET_MODULES", "Target", "all_targets", "corpus_files", "fuzz_settings", "get_target",
           "make_tests", "mutate_once", "run_cases", "run_mutations", "save_example"]

CORPUS = Path(__file__).resolve().parent.parent / "fuzz_corpus"
#: Where the targets live (module -> its ``TARGETS``), imported on demand: the ingest target builds a dashboard.
TARGET_MODULES = ("tests.fuzzing.swarm", "tests.fuzzing.codecs", "tests.fuzzing.files", "tests.fuzzing.ingest")
#: Per-case deadline: every input is a few KB and parses in milliseconds; one that takes this long
#: hangs (the margin is for a loaded CI machine, where a slow case must not read as a flaky failure).
DEADLINE_MS = 30_000


@dataclass(frozen=True)
class Target:
    """One parser under fuzz: ``inputs`` draws bytes, ``run`` parses them (see the module doc).

    ``min_outcomes``: how many distinct outcomes (accepted and each refusal reason) a CI run
    must reach, so a generator that only ever makes one kind of garbage fails its test."""

    name: str
    inputs: st.SearchStrategy[bytes]
    run: Callable[[bytes], str]
    min_outcomes: int = 3


def fuzz_settings(cases: int | None = None, *, derandomize: bool = True) -> settings:
    """The suite's Hypothesis settings: ``cases`` examples (``FEDSWARM_FUZZ_CASES``, default
    2,000), reproducible (derandomized) for CI, no example database (the corpus is ours)."""
    if cases is None:
        cases = int(os.environ.get("FEDSWARM_FUZZ_CASES", "2000"))
    return settings(max_examples=cases, deadline=DEADLINE_MS, derandomize=derandomize, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.large_base_example, HealthCheck.filter_too_much],
                    print_blob=False)


def all_targets() -> dict[str, Target]:
    out: dict[str, Target] = {}
    for mod in TARGET_MODULES:
        for t in importlib.import_module(mod).TARGETS:
            out[t.name] = t
    return out


def get_target(name: str) -> Target:
    for mod in TARGET_MODULES:
        for t in importlib.import_module(mod).TARGETS:
            if t.name == name:
                return t
    raise KeyError(name)


def corpus_files(name: str) -> list[Path]:
    """The saved examples of target ``name`` (each a defect once found, now a regression test)."""
    folder = CORPUS / name
    return sorted(folder.glob("*.bin")) if folder.is_dir() else []


def save_example(name: str, data: bytes) -> Path:
    """Keep ``data`` as ``tests/fuzz_corpus/<name>/<sha256 prefix>.bin``; returns the path."""
    folder = CORPUS / name
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{hashlib.sha256(data).hexdigest()[:16]}.bin"
    path.write_bytes(data)
    return path


def run_cases(target: Target, cases: int | None = None, *, seed: int | None = None,
              on_failure: Callable[[bytes], None] | None = None, outcomes: Counter | None = None) -> Counter:
    """Run ``cases`` Hypothesis examples of ``target``; the count of each outcome. A defect
    raises (after Hypothesis shrank it); ``on_failure`` first gets the smallest failing input.
    ``seed``: a random run with that seed (None: the reproducible CI sequence). ``outcomes``:
    a Counter to add to (it keeps the counts of a run that found a defect)."""
    outcomes = Counter() if outcomes is None else outcomes
    failing: list[bytes] = []

    @fuzz_settings(cases, derandomize=seed is None)
    @given(target.inputs)
    def one(data: bytes) -> None:
        try:
            outcomes[target.run(data)] += 1
        except BaseException:
            failing.append(data)  # Hypothesis runs the shrunk example last
            raise

    if seed is not None:
        one = with_seed(seed)(one)
    try:
        one()
    except BaseException as exc:
        # Hypothesis reports each distinct defect with its shrunk example, replayed last
        found = len(exc.exceptions) if isinstance(exc, BaseExceptionGroup) else 1
        for data in failing[-found:] if on_failure is not None else ():
            on_failure(data)
        raise
    return outcomes


_INTERESTING = [b"\x00", b"\xff", b"\x7f", b"\x80", b"\x00\x00\x00\x00", b"\xff\xff\xff\xff", b"\x7f\xff\xff\xff",
                b"\x80\x00\x00\x00", b"\x00\x00\x01\x00", b"[", b"{", b'"', b"NaN", b"1e400", b"-1", b"\n"]


def mutate_once(rng: random.Random, data: bytes) -> bytes:
    """``data`` with one to four random byte-level edits (AFL's havoc, in short): flip a byte,
    write an interesting value, insert, delete or duplicate a range, cut the tail."""
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        n = len(b)
        pos = rng.randrange(n) if n else 0
        op = rng.randrange(6)
        if op == 0 and n:
            b[pos] ^= 1 << rng.randrange(8)
        elif op == 1:
            v = rng.choice(_INTERESTING)
            b[pos:pos + len(v)] = v
        elif op == 2:
            b[pos:pos] = rng.randbytes(rng.randint(1, 8))
        elif op == 3 and n:
            del b[pos:pos + rng.randint(1, 16)]
        elif op == 4 and n:
            b[pos:pos] = b[pos:pos + rng.randint(1, 64)]
        elif op == 5:
            del b[pos:]
    return bytes(b)


def run_mutations(target: Target, cases: int, *, seed: int, pool_size: int = 200,
                  on_failure: Callable[[bytes], None] | None = None, outcomes: Counter | None = None) -> int:
    """The fast engine of ``scripts/fuzz --engine mutate``: ``pool_size`` structure-aware inputs
    drawn from ``target.inputs`` (Hypothesis, seeded), then ``cases`` byte-level mutants of them
    (:func:`mutate_once`), each fed to ``target.run``: the cost of a case is the parser's. Every
    failing input goes to ``on_failure`` unshrunk; returns how many failed."""
    outcomes = Counter() if outcomes is None else outcomes
    pool: list[bytes] = []

    @fuzz_settings(pool_size, derandomize=False)
    @given(target.inputs)
    def collect(data: bytes) -> None:
        pool.append(data)

    with_seed(seed)(collect)()
    rng, failed = random.Random(seed), 0
    for _ in range(cases):
        data = mutate_once(rng, rng.choice(pool))
        try:
            outcomes[target.run(data)] += 1
        except Exception:
            failed += 1
            outcomes["defect"] += 1
            if on_failure is not None:
                on_failure(data)
    return failed


def make_tests(names: list[str]):
    """The two tests of a ``tests/test_fuzz_*.py`` module for the targets ``names``: each target's
    fuzz run (``FEDSWARM_FUZZ_CASES`` cases, reproducible), and a replay of every corpus file."""
    import pytest

    @pytest.mark.timeout(900)  # ~10-20 s of CPU a target; a loaded machine may take many times that
    @pytest.mark.parametrize("name", names)
    def test_fuzz(name):
        target = get_target(name)
        outcomes = run_cases(target)
        # the inputs reach past the first check: some are accepted, and several distinct refusals happen
        assert outcomes["accepted"] > 0, outcomes
        assert len(outcomes) >= target.min_outcomes, outcomes

    @pytest.mark.parametrize("path", [p for n in names for p in corpus_files(n)],
                             ids=lambda p: f"{p.parent.name}/{p.stem}")
    def test_replay_corpus(path):
        get_target(path.parent.name).run(path.read_bytes())

    return test_fuzz, test_replay_corpus
