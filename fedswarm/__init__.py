"""fedswarm: federated and decentralized learning on Flower and PyTorch."""

import os as _os

__version__ = "0.1.0"

# The subpackages live in sibling folders of this one in the source tree (pyproject.toml's
# package-dir: fedswarm.client is client/, fedswarm.server is server/, ...). An installed copy
# has them inside this folder. A Flower App run on a SuperNode or a SuperLink (`flwr run .`)
# is unpacked as the source tree and put first on sys.path, so its `fedswarm/` shadows the
# installed package: from a source tree, look for the subpackages beside this folder too.
_here = _os.path.dirname(_os.path.abspath(__file__))
_root = _os.path.dirname(_here)
if not _os.path.isdir(_os.path.join(_here, "client")) and _os.path.isfile(_os.path.join(_root, "client", "app.py")):
    __path__.append(_root)  # noqa: F821  (a package's __path__)
del _here, _root
