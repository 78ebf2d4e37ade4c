"""The history: one JSON object a line, times in seconds on one monotonic clock from the run's
start. The format is described in `faults/README.md`; the checker reads nothing else."""

from __future__ import annotations

import json
import time
from pathlib import Path


class History:
    def __init__(self, path: Path):
        self.path = path
        self.file = open(path, "w", encoding="utf-8")
        self.origin = time.monotonic()
        self.fault_ids = 0
        self.lines = 0

    def now(self) -> float:
        return round(time.monotonic() - self.origin, 6)

    def write(self, event: dict) -> None:
        self.file.write(json.dumps(event, separators=(",", ":")) + "\n")
        self.lines += 1
        if self.lines % 1000 == 0:
            self.file.flush()

    def fault_start(self, kind: str, target: str, **params) -> int:
        self.fault_ids += 1
        self.write({"type": "fault", "id": self.fault_ids, "kind": kind, "phase": "start",
                    "t": self.now(), "target": target, "params": params})
        return self.fault_ids

    def fault_end(self, fault_id: int, kind: str) -> None:
        self.write({"type": "fault", "id": fault_id, "kind": kind, "phase": "end", "t": self.now()})

    def close(self) -> None:
        self.file.close()
