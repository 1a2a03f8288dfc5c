"""The errors several layers raise, here at the bottom so that any layer may raise or catch
them without importing a layer above it: the algorithms raise :class:`ConfigError` as
:mod:`fedswarm.config` does, yet sit under it (config checks settings with the algorithms'
own parsers); a strategy raises :class:`CheckpointError` as the ServerApp's checkpoints do.
docs/architecture.md has the layers.
"""

from __future__ import annotations

__all__ = ["ConfigError", "CheckpointError"]


class ConfigError(ValueError):
    """A bad config key or value; the message is one line fit to show a user."""


class CheckpointError(RuntimeError):
    """No usable server checkpoint, or one this code cannot continue from."""
