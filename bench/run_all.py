"""``make bench``: every study, one after the other, and an index (`pdserve study all`).

    python -m bench.run_all --quick --out bench/results     # ~6 min on 2 cores, tiny model

Writes each study's files and ``OUT/README.md`` linking every table, plot and trace
(see :func:`bench.study.run_all`); ``--studies a,b`` runs a subset. The flags are
`pdserve study`'s.
"""

from __future__ import annotations

import sys

from bench.cli import study_main


def main(argv: list[str] | None = None) -> int:
    return study_main(["all", *(sys.argv[1:] if argv is None else argv)],
                      prog="python -m bench.run_all", description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
