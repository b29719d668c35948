"""Logging: every line one JSON object (or plain text), whoever logs it.

``log_config`` is the one ``logging.config.dictConfig`` of a server process: a single
handler on stderr, on the root logger, with our formatter; uvicorn's loggers and every
library's (OpenTelemetry, gRPC) propagate to it, so no line escapes the format. uvicorn
applies it in every process it starts (``uvicorn.run(log_config=...)``); the app applies it
again when it is built from the environment.

A line repeated by a client cannot flood the log: :class:`RepeatFilter` lets the first
``REPEAT_BURST`` lines of one (logger, message template) through in each
``REPEAT_WINDOW_SECONDS``, then drops the rest of that window and reports how many it
dropped on the next line it lets through (``"repeated": n``). The request log of traced
requests (``service.requests``) is never limited.
"""

from __future__ import annotations

import json
import logging
import logging.config
import threading
import time

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
    "color_message",  # uvicorn's coloured copy of the message
    "taskName",
}
REPEAT_WINDOW_SECONDS = 10.0
REPEAT_BURST = 5
# loggers whose every line is wanted: one line per traced request (service.ops.tracing)
UNLIMITED_LOGGERS = frozenset({"service.requests"})


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        payload = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        payload.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            payload["exception"] = self.formatException(record.exc_info)
        return json.dumps(payload, default=str)


class RepeatFilter(logging.Filter):
    """At most REPEAT_BURST lines per (logger, template) per REPEAT_WINDOW_SECONDS."""

    def __init__(self, name: str = "") -> None:
        super().__init__(name)
        self.lock = threading.Lock()
        self.windows: dict[tuple[str, str], list] = {}  # key -> [window start, seen, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name in UNLIMITED_LOGGERS:
            return True
        key = (record.name, str(record.msg))
        now = time.monotonic()
        with self.lock:
            window = self.windows.get(key)
            if window is None or now - window[0] >= REPEAT_WINDOW_SECONDS:
                dropped = window[2] if window is not None else 0
                if len(self.windows) > 1000:
                    self.windows.clear()  # bounded: templates are few, messages are not
                self.windows[key] = [now, 1, 0]
                if dropped:
                    record.repeated = dropped
                return True
            window[1] += 1
            if window[1] <= REPEAT_BURST:
                return True
            window[2] += 1
            return False


def log_config(level: str = "info", json_lines: bool = True) -> dict:
    """The dictConfig of a server process (see the module docstring)."""
    formatter = (
        {"()": JsonFormatter}
        if json_lines
        else {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}
    )
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"line": formatter},
        "filters": {"repeats": {"()": RepeatFilter}},
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "stream": "ext://sys.stderr",
                "formatter": "line",
                "filters": ["repeats"],
            }
        },
        "root": {"handlers": ["stderr"], "level": "WARNING"},
        "loggers": {
            **{
                name: {"handlers": [], "level": level.upper(), "propagate": True}
                for name in ("service", "uvicorn", "uvicorn.error")
            },
            # no access log: requests are counted in /metrics and, when traced, logged by
            # service.requests with their trace id (uvicorn writes access lines whenever
            # this logger has a handler, its own or an ancestor's)
            "uvicorn.access": {"handlers": [], "level": "WARNING", "propagate": False},
        },
    }


def configure_logging(level: str = "info", json_lines: bool = True) -> None:
    logging.config.dictConfig(log_config(level, json_lines))
