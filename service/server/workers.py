"""Several uvicorn workers serving one model, or one model repository: the reload
generation and the repository's actions they share.

``python -m service --workers N`` creates a runtime directory (``NCAKNN_RUNTIME_DIR``) before
the workers start. A worker that reloads the model on request writes a new token to
``reload-generation`` there (written to a temporary file and renamed); every worker checks
the token every ``worker_sync_seconds`` and reloads when it changed, so all workers converge
on the new model within that time. With a model repository, a worker that loads or unloads a
model on request records the action in ``repository-actions.json`` there
(:class:`RepositoryActions`); every worker replays the actions it has not seen, so all
workers serve the same models within ``worker_sync_seconds``. Prometheus's multiprocess files live beside it
(``metrics/``), so /metrics sums every worker whichever one answers.
"""

from __future__ import annotations

import fcntl
import json
import os
import uuid
from contextlib import contextmanager
from pathlib import Path

GENERATION_FILE = "reload-generation"
ACTIONS_FILE = "repository-actions.json"  # {name: {"action": "load"|"unload", "token": ...}}
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


class RepositoryActions:
    """The last load or unload asked of each repository model, shared by the workers.

    ``record`` rewrites the file under an exclusive lock (a temporary file renamed over it),
    so two workers recording at once lose neither action. ``wanted`` is what the file asks
    now, {name: (action, token)}; ``applied`` is {name: token} of the actions this worker
    has carried out (its own, and those it replayed: ``Repository.replay``)."""

    def __init__(self, runtime_dir: Path):
        self.path = Path(runtime_dir) / ACTIONS_FILE
        self.lock_path = Path(runtime_dir) / f".{ACTIONS_FILE}.lock"
        self.applied: dict[str, str] = {}

    def read(self) -> dict:
        try:
            actions = json.loads(self.path.read_text())
        except (FileNotFoundError, ValueError):
            return {}
        return actions if isinstance(actions, dict) else {}

    def wanted(self) -> dict[str, tuple[str, str]]:
        """{name: (action, token)}, the well-formed entries of the file."""
        wanted = {}
        for name, entry in self.read().items():
            if isinstance(entry, dict) and entry.get("action") in ("load", "unload"):
                if isinstance(entry.get("token"), str):
                    wanted[name] = (entry["action"], entry["token"])
        return wanted

    @contextmanager
    def _locked(self):
        with open(self.lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def record(self, name: str, action: str) -> None:
        """Announce that this worker applied ``action`` ("load" or "unload") to ``name``."""
        token = uuid.uuid4().hex
        with self._locked():
            actions = self.read()
            actions[name] = {"action": action, "token": token}
            tmp = self.path.with_name(f".{ACTIONS_FILE}.{os.getpid()}-{token[:8]}")
            tmp.write_text(json.dumps(actions, sort_keys=True))
            os.replace(tmp, self.path)
        self.applied[name] = token
