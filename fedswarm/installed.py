"""Where a file of the installed fedswarm lives, for code that runs from a copy of fedswarm
that lacks it (a Flower App bundle carries only ``.py``, ``.toml``, ``.md`` and a few other kinds
of file): the installed distribution's own copy (a wheel's package data), or an editable
install's tree (PEP 610's ``direct_url.json``)."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

__all__ = ["installed_file"]


def installed_file(package_path: str, tree_path: str) -> Path | None:
    """The installed fedswarm's file ``package_path`` (as the wheel lists it, e.g.
    ``fedswarm/algorithms/compression/csrc/fs_kernels.h``), or ``tree_path`` below an editable
    install's project folder (e.g. ``algorithms/compression/csrc/fs_kernels.h``); None if neither
    exists. Every fedswarm on ``sys.path`` is looked at: a stale egg-info may come first."""
    for dist in metadata.distributions(name="fedswarm"):
        for f in dist.files or ():
            if str(f).replace("\\", "/").endswith(package_path):
                p = Path(str(dist.locate_file(f)))
                if p.is_file():
                    return p
        url = json.loads(dist.read_text("direct_url.json") or "{}")
        if url.get("dir_info", {}).get("editable") and str(url.get("url", "")).startswith("file://"):
            p = Path(unquote(urlparse(url["url"]).path)) / tree_path
            if p.is_file():
                return p
    return None
