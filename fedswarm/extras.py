"""Which optional parts of fedswarm are installed, and the one line that says how to get one.

``pip install fedswarm`` is what a device needs to train and join: the ClientApp, the tasks,
the algorithms and the swarm peer. Server-side parts are extras named for what they serve
(``pyproject.toml``):

- ``server``: the ServerApp's privacy accounting (``dp-accounting``, which brings SciPy);
- ``dashboard``: the web dashboard (FastAPI, uvicorn, Jinja2, rate limits, form uploads, the
  offline API reference, Prometheus metrics, the TOML a run from the dashboard starts with);
- ``sim``: the simulation engines and the built-in digits data (Ray, scikit-learn,
  flwr-datasets, Matplotlib, Opacus), with ``server``.

A command that needs an extra checks for it before it starts (:func:`require`), by looking
the modules up without importing them, and fails with one line naming the extra.
"""

from __future__ import annotations

import importlib.util

__all__ = ["EXTRAS", "MissingExtra", "missing", "require", "install_hint", "check_run_extras"]

# extra -> the import names it provides that fedswarm uses (looked up, never imported here).
EXTRAS: dict[str, tuple[str, ...]] = {
    "server": ("dp_accounting",),
    "dashboard": ("fastapi", "uvicorn", "jinja2", "limits", "multipart", "swagger_ui", "prometheus_client", "tomli_w"),
    "sim": ("ray", "sklearn", "flwr_datasets", "matplotlib", "opacus"),
}


class MissingExtra(ImportError):
    """An optional part of fedswarm is not installed; the message names the extra."""


def install_hint(extra: str) -> str:
    return f"pip install 'fedswarm[{extra}]' (from a checkout: pip install -c requirements/lock.txt -e '.[{extra}]')"


def missing(extra: str, modules: tuple[str, ...] | None = None) -> list[str]:
    """The modules of ``extra`` (or just ``modules`` of it) that cannot be imported here."""
    names = EXTRAS[extra] if modules is None else modules
    out = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(name)
    return out


def require(extra: str, what: str, modules: tuple[str, ...] | None = None) -> None:
    """Raise :class:`MissingExtra` with one line if ``what`` (e.g. "fedswarm dashboard")
    cannot run because modules of ``extra`` are not installed."""
    gone = missing(extra, modules)
    if gone:
        raise MissingExtra(f"{what} needs the [{extra}] extra ({', '.join(gone)} not installed): "
                           f"{install_hint(extra)}")


def check_run_extras(cfg) -> None:
    """What a run (a :class:`~fedswarm.config.RunConfig`) needs beyond the base install, named in
    one line (a ``ConfigError``) if it is missing."""
    from fedswarm.errors import ConfigError

    try:
        if cfg.engine == "flower":
            require("sim", "--engine flower", modules=("ray",))
        if cfg.dp or cfg.dp_sgd:
            require("server", "--dp" if cfg.dp else "--dp-sgd", modules=("dp_accounting",))
    except MissingExtra as exc:
        raise ConfigError(str(exc)) from None
