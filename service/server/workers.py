"""Several uvicorn workers serving one model: the reload generation they share.

``python -m service --workers N`` creates a runtime directory (``NCAKNN_RUNTIME_DIR``) before
the workers start. A worker that reloads the model on request writes a new token to
``reload-generation`` there (written to a temporary file and renamed); every worker checks
the token every ``worker_sync_seconds`` and reloads when it changed, so all workers converge
on the new model within that time. Prometheus's multiprocess files live beside it
(``metrics/``), so /metrics sums every worker whichever one answers.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

GENERATION_FILE = "reload-generation"
METRICS_DIR = "metrics"


class ReloadGeneration:
    def __init__(self, runtime_dir: Path):
        self.path = Path(runtime_dir) / GENERATION_FILE
        self.seen = self.read()

    def read(self) -> str | None:
        try:
            return self.path.read_text().strip() or None
        except FileNotFoundError:
            return None

    def bump(self) -> str:
        """Announce a reload to the other workers."""
        token = uuid.uuid4().hex
        tmp = self.path.with_name(f".{GENERATION_FILE}.{os.getpid()}-{token[:8]}")
        tmp.write_text(token)
        os.replace(tmp, self.path)
        self.seen = token
        return token

    def changed(self) -> bool:
        """True once per new token written by another worker."""
        token = self.read()
        if token is None or token == self.seen:
            return False
        self.seen = token
        return True
