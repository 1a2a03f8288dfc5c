"""Every option fedswarm hands to Flower's ``flower-superlink`` and ``flower-supernode`` exists in
the installed Flower and is not one it marks deprecated.

Flower retires transport options in two steps: a release keeps accepting an option while its
``--help`` calls it deprecated (1.41 and 1.42: ``--fleet-api-type``, ``--fleet-api-address``,
``--control-api-address``, the public-key options), a later one stops honouring or accepting it
(1.43: Fleet and Control over HTTP only, the gRPC services gone). A deprecated option still starts
the process, so the deployment tests would pass on it until the release that drops it; this test
fails on the first release that deprecates it instead. Checked: the SuperNode command of
``fedswarm client`` with every option on, the SuperLink command of the deployment tests, and every
``flower-superlink``/``flower-supernode`` command in the README and docs/ (the ones users copy).
See docs/flower-versions.md."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from fedswarm.client.supernode import supernode_command
from fedswarm.tasks.localdata import LocalDataSpec
from tests.deployment_helpers import BIN, Deployment

ROOT = Path(__file__).resolve().parents[1]
OPTION = re.compile(r"^  (?:-\w, )?(--[\w-]+)")
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def flower_options(program: str) -> tuple[set[str], set[str]]:
    """(every option, the deprecated ones) of ``program --help`` as the installed Flower prints it."""
    out = subprocess.run([str(BIN / program), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    options: dict[str, list[str]] = {}
    current = None
    for line in out.stdout.splitlines():
        m = OPTION.match(line)
        if m:
            current = m.group(1)
            options[current] = [line[m.end():]]
        elif current is not None and line.startswith("   "):
            options[current].append(line)
        else:
            current = None
    # the parse is right only if it found options every Flower release of this range has
    assert {"--insecure", "--help"} <= set(options), f"could not read {program}'s options:\n{out.stdout}"
    deprecated = {o for o, text in options.items() if "deprecated" in " ".join(text).lower()}
    return set(options), deprecated


@pytest.fixture(scope="module")
def superlink_options():
    return flower_options("flower-superlink")


@pytest.fixture(scope="module")
def supernode_options():
    return flower_options("flower-supernode")


def used(cmd: list[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in cmd if a.startswith("--")}


def check(program: str, options: set[str], known: tuple[set[str], set[str]], where: str) -> None:
    everything, deprecated = known
    assert options, f"no options read from {where}"
    assert not options - everything, f"{where}: {program} has no option {sorted(options - everything)}"
    assert not options & deprecated, f"{where}: {program} deprecates {sorted(options & deprecated)}"


def test_fedswarm_client_supernode_command(tmp_path, supernode_options):
    key = tmp_path / "sn0.key"
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key.write_bytes(ec.generate_private_key(ec.SECP384R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()))
    key.chmod(0o600)
    secure = supernode_command("127.0.0.1:9093", 0, 2, device_class="cpu", root_certificates=tmp_path / "ca.pem",
                               clientappio_port=9095, auth_private_key=key, state_dir=tmp_path, keep_runs=3,
                               local=LocalDataSpec(str(tmp_path / "d.npz"), "label", 0.1), device="cpu")
    plain = supernode_command("127.0.0.1:9093", 0, 2, device_class="cpu", insecure=True, state_dir=tmp_path)
    for cmd in (secure, plain):
        check("flower-supernode", used(cmd), supernode_options, "fedswarm client")


def test_deployment_tests_superlink_command(tmp_path, superlink_options):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for dep in (Deployment(tmp_path / "a", ""), Deployment(tmp_path / "b", "", pki=tmp_path / "pki")):
        try:
            check("flower-superlink", used(dep.superlink_command()), superlink_options, "tests/deployment_helpers.py")
        finally:
            dep.log.close()


def doc_commands(program: str) -> list[tuple[str, list[str]]]:
    """(where, argv) of every shell line in README.md and docs/*.md that runs ``program``,
    backslash continuations joined, a trailing comment dropped."""
    found = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            start = i
            text = lines[i]
            while text.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                text = text.rstrip()[:-1] + " " + lines[i]
            words = text.split("#", 1)[0].split()
            if words and words[0] == program:
                found.append((f"{path.relative_to(ROOT)}:{start + 1}", words))
            i += 1
    return found


def test_commands_in_readme_and_docs(superlink_options, supernode_options):
    link = doc_commands("flower-superlink")
    assert link, "the README's deployment section runs flower-superlink; none found"
    for where, cmd in link:
        check("flower-superlink", used(cmd), superlink_options, where)
    for where, cmd in doc_commands("flower-supernode"):
        check("flower-supernode", used(cmd), supernode_options, where)


def test_the_reader_finds_what_flower_deprecates(superlink_options):
    """The reader itself, so that the checks above cannot pass by reading nothing: this Flower
    range's SuperLink lists its gRPC transport option as deprecated (1.43 retires it: then this
    test asks for the option the new release deprecates instead)."""
    everything, deprecated = superlink_options
    assert "--fleet-api-type" in everything, (
        "flower-superlink has no --fleet-api-type any more (Flower >= 1.43?): see docs/flower-versions.md, "
        "and hold this test to an option the new release deprecates")
    assert "--fleet-api-type" in deprecated and "--insecure" not in deprecated, sorted(deprecated)
