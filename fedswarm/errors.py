"""The errors every layer raises, here at the bottom so that any layer may raise or catch
them without importing the one above it (``fedswarm.algorithms`` raises :class:`ConfigError`
yet sits under :mod:`fedswarm.config`, which imports it; docs/architecture.md has the layers).
"""

from __future__ import annotations

__all__ = ["ConfigError", "CheckpointError"]


class ConfigError(ValueError):
    """A bad config key or value; the message is one line fit to show a user."""


class CheckpointError(RuntimeError):
    """No usable server checkpoint, or one this code cannot continue from."""
