"""``--help`` shows what every argument and option is for, on every command of ``fedswarm``.

Guards a dependency trap that hid it: click 8.5 gave ``click.Argument`` a ``help`` of its own, and
the typer that flwr allows (< 0.21) set the text before click's constructor reset it to None, so
every positional argument's help (``fedswarm bench NAME``: which benchmarks exist) vanished."""

from __future__ import annotations

import re

import click
import typer.main
from typer.testing import CliRunner

from fedswarm.cli import app

BOX = re.compile(r"[│╭╮╰╯─┃━┏┓┗┛]")


def _commands(cmd: click.Command, path: tuple[str, ...] = ()):
    yield path, cmd
    if isinstance(cmd, click.Group):
        for name, sub in cmd.commands.items():
            yield from _commands(sub, (*path, name))


def _flat(text: str) -> str:
    """Words only: no panel borders, backticks or rich markup, one space between words."""
    return " ".join(re.sub(r"\[/?[a-z ]+\]|`", "", BOX.sub(" ", text)).split())


def test_every_argument_and_option_shows_its_help():
    root = typer.main.get_command(app)
    runner = CliRunner()
    arguments = 0
    for path, cmd in _commands(root):
        if isinstance(cmd, click.Group):
            continue
        out = runner.invoke(app, [*path, "--help"], terminal_width=200, env={"COLUMNS": "200"})
        assert out.exit_code == 0, (path, out.output)
        shown = _flat(out.output)
        for param in cmd.params:
            if isinstance(param, click.Argument):
                arguments += 1
                assert param.help, f"fedswarm {' '.join(path)}: argument {param.name} has no help text"
            if getattr(param, "help", None) and not getattr(param, "hidden", False):
                words = " ".join(_flat(param.help).split()[:4])
                assert words in shown, (path, param.name, words)
    assert arguments >= 3  # bench NAME, resume RUN_ID, export RUN_ID at least


def test_bench_help_names_every_registered_benchmark():
    from fedswarm.bench.registry import BENCHMARKS

    out = CliRunner().invoke(app, ["bench", "--help"], terminal_width=200, env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    text = _flat(out.output)
    assert [name for name in BENCHMARKS if not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text)] == []
