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
