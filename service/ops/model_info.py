"""``ncaknn_model_info``: one series per worker, naming the model it serves now.

prometheus-client cannot remove a label set in multiprocess mode (a child stays in the
worker's file with its last value), so a gauge labelled by version would keep one series
per version ever loaded. This collector keeps the current labels instead: in one process,
in memory; with several workers (``PROMETHEUS_MULTIPROC_DIR``), in one small file per
worker beside prometheus-client's (``model_info_<pid>.json``, replaced atomically), read
at every scrape for the workers whose process is alive (``tests/service/ops/test_model_info.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path

from prometheus_client.core import GaugeMetricFamily

from service.core.processes import process_alive

NAME = "ncaknn_model_info"
DOCUMENTATION = "the model this worker serves (value 1): one series per worker"
FILE_PREFIX = "model_info_"

log = logging.getLogger("service.ops.model_info")


class ModelInfo:
    """The current (model_version, index_type) of this worker, and of every live worker
    when ``directory`` (the multiprocess directory) is given; a Prometheus collector."""

    def __init__(self, directory: str | os.PathLike | None = None):
        self.directory = Path(directory) if directory else None
        self.labels: tuple[str, str] | None = None

    def set(self, model_version: str, index_type: str) -> None:
        """The model this worker serves from now on (the previous one's series goes). Never
        raises: the model is already swapped in when this is called, so a file that cannot
        be written (a full or read-only directory) removes this worker's series, rather
        than leave the previous model's, and is logged as a warning."""
        self.labels = (model_version, index_type)
        if self.directory is None:
            return
        pid = os.getpid()
        target = self.directory / f"{FILE_PREFIX}{pid}.json"
        staging = self.directory / f".{FILE_PREFIX}{pid}.json.tmp"
        try:
            staging.write_text(
                json.dumps({"model_version": model_version, "index_type": index_type})
            )
            os.replace(staging, target)
        except OSError as exc:
            for stale in (staging, target):
                with contextlib.suppress(OSError):
                    stale.unlink(missing_ok=True)
            log.warning(
                "ncaknn_model_info cannot name this worker's model: its file cannot be written",
                extra={"path": str(target), "error": str(exc), "model_version": model_version},
            )

    def describe(self):
        yield self._family()

    def collect(self):
        family = self._family()
        if self.directory is None:
            if self.labels is not None:
                family.add_metric(list(self.labels), 1)
        else:
            for pid, labels in sorted(self._workers().items()):
                family.add_metric([*labels, str(pid)], 1)
        yield family

    def _family(self) -> GaugeMetricFamily:
        names = ["model_version", "index_type"] + ([] if self.directory is None else ["pid"])
        return GaugeMetricFamily(NAME, DOCUMENTATION, labels=names)

    def _workers(self) -> dict[int, tuple[str, str]]:
        """{pid: (model_version, index_type)} of the live workers that loaded a model."""
        workers = {}
        for path in self.directory.glob(f"{FILE_PREFIX}*.json"):
            try:
                pid = int(path.name[len(FILE_PREFIX) : -len(".json")])
                record = json.loads(path.read_text())
                labels = (str(record["model_version"]), str(record["index_type"]))
            except (OSError, ValueError, KeyError, TypeError):
                continue  # replaced or removed while read, or not one of ours
            if pid > 0 and process_alive(pid):
                workers[pid] = labels
        return workers
