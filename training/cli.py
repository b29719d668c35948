"""Command line: ``python -m training`` / ``nca-train``. See ``python -m training --help``."""

from __future__ import annotations

import sys

from service.artifact import ArtifactError
from training.config import parse_config
from training.data import DataError
from training.job import ConfigError, run


def main(argv: list[str] | None = None) -> int:
    config = parse_config(argv)
    try:
        run(config, log=lambda message: print(message, file=sys.stderr))
    except (DataError, ConfigError, ArtifactError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
