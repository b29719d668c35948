"""Command line: ``python -m training`` / ``nca-train``. See ``python -m training --help``."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch.distributed as dist

from training.config import ReportCommand, TrainConfig, parse_command
from training.distributed.ranks import init_from_environment
from training.errors import (
    REFUSED,
    Interrupted,
    describe_os_error,
    interrupted_line,
    print_output,
    raise_on_file_size_limit,
    raise_on_interrupt,
    refusal,
)
from training.evaluation.report_page import write_report_page
from training.job import checkpoint_dir_for, run
from training.references.cli import main as references_main


def main(argv: list[str] | None = None) -> int:
    """Run the job; exit status 0, or 2 with one line on stderr for bad input, for settings
    that drive the fit out of floating-point range (FloatingPointError), or for output that
    cannot be written (a full or read-only disk, the file-size limit: the path and the
    cause; ``training.errors``).

    Under ``torchrun`` the job is data-parallel (``training.distributed.ranks``): every rank runs
    this, only rank 0 logs, and an error names the rank that met it. torchrun ends the
    other ranks when one fails, and the job's exit status is non-zero."""
    raise_on_file_size_limit()
    started = time.perf_counter()
    argv = sys.argv[1:] if argv is None else argv
    config = parse_command(argv)
    raise_on_interrupt()
    if isinstance(config, ReportCommand):
        return report_main(config)
    if not isinstance(config, TrainConfig):  # python -m training references ...
        return references_main(config)
    group = init_from_environment(config.device)
    where = f" (rank {group.rank} of {group.world_size})" if group.is_distributed else ""

    def log(message: str) -> None:
        if group.rank == 0:
            print(message, file=sys.stderr, flush=True)

    try:
        run(config, log=log)
    except REFUSED as exc:
        return _fail(f"error{where}: {refusal(exc)}")
    except Interrupted as exc:  # SIGINT or SIGTERM: one line, no traceback
        checkpoint = checkpoint_dir_for(config, Path(config.out)) if config.out else None
        line = interrupted_line(
            exc, time.perf_counter() - started, config.out or "--out", checkpoint
        )
        return _fail(f"error{where}: {line}", exc.exit_status)
    finally:
        if group.is_distributed and dist.is_initialized():
            dist.destroy_process_group()
    return 0


def report_main(command: ReportCommand) -> int:
    """``python -m training report MODEL_DIR``: 0 and the page's path, or 2 and why not
    (also when the path cannot be written to stdout)."""
    try:
        page = write_report_page(command.model_dir)
    except REFUSED as exc:
        return _fail(f"error: {refusal(exc)}")
    failed = print_output(str(page))
    if failed is not None:
        return _fail(
            f"error: cannot write the page's path to standard output: "
            f"{describe_os_error(failed)}; the page was written at {page}"
        )
    return 0


def _fail(line: str, status: int = 2) -> int:
    """``line`` on stderr, flushed; returns ``status``."""
    print(line, file=sys.stderr, flush=True)
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
