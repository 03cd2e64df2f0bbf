"""What a peer writes under its own run directory (`RUN_DIR/peers/`), for `swarm report` and `swarm local`
to gather: JSON summaries, and JSON-lines logs appended to as events happen (so a killed peer's history
survives it). Every file is named after the peer id, so the run directories of many hosts merge
without collisions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class PeerResults:
    def __init__(self, run_dir: str | Path):
        self.dir = Path(run_dir) / "peers"

    def path(self, name: str) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        return self.dir / name

    def write(self, name: str, summary: dict[str, Any], indent: int | None = None) -> None:
        self.path(name).write_text(json.dumps(summary, indent=indent))

    def append(self, name: str, event: dict[str, Any]) -> None:
        with open(self.path(name), "a") as out:
            out.write(json.dumps(event) + "\n")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines log (none if it does not exist), read while its peer may still be appending:
    text after the last newline is a record still being written (a long one takes more than one write), left
    for a later read."""
    if not path.exists():
        return []
    complete = path.read_text().rpartition("\n")[0]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]
