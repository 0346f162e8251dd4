"""The ending of the PASS / FAIL check scripts: a count, the rows as JSON, an exit status."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def finish(rows: list[dict], json_path: Path | None) -> None:
    """Print ``k/n PASS``, write ``rows`` to ``json_path`` (if given) and exit 1 when any row failed."""
    failed = sum(r["status"] != "PASS" for r in rows)
    print(f"{len(rows) - failed}/{len(rows)} PASS")
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(rows, indent=1))
    sys.exit(1 if failed else 0)
