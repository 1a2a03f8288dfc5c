"""``python -m fedswarm.bench.papers combine OUT RUN_DIR [RUN_DIR ...]``: merge the
``papers.json`` of several ``fedswarm bench papers`` runs into ``OUT`` (later runs win for
the claims they measured), with ``OUT/reproductions.md`` regenerated from them."""

from __future__ import annotations

import sys
from pathlib import Path

from fedswarm.bench.papers import CLAIMS
from fedswarm.bench.papers.report import combine


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[0] != "combine":
        print(__doc__.strip(), file=sys.stderr)
        return 2
    merged = combine([Path(a) for a in argv[2:]], Path(argv[1]), [c.id for c in CLAIMS])
    for e in merged["claims"]:
        print(f"  {e['id']:<14} {e['mode']:<6} {e['verdict']:<15} {e['ours']}")
    print(f"wrote {Path(argv[1]) / 'reproductions.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
