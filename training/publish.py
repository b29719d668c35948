"""Publishing an artifact: atomically pointing a symlink (``--publish``) at a new artifact
directory, for the training job and the references command alike.

A server polling the link (``service`` with ``reload_poll_seconds``) sees either the old
target or the new one, never a half-made link: the new link is made under a temporary name
beside the old one and renamed over it (``rename(2)`` replaces a symlink atomically). The
temporary names carry the publisher's host and pid, so that the next write cleans up after a
killed publisher and never after a live one.
"""

from __future__ import annotations

import os
from pathlib import Path

from service.core.artifact.format import MANIFEST_FILE
from service.core.artifact.write import remove_stale_staging, staging_path
from training.errors import ConfigError, writing


def check_publish_link(link: str | None, out: str | os.PathLike | None = None) -> None:
    """ConfigError when ``link`` exists and is not a symlink (it is never replaced), is a
    symlink to something that exists and is not a model artifact (a directory holding
    ``manifest.json``: a link we did not make, to the user's data, is never repointed; a
    dangling link is), or names the same path as ``out`` (the artifact would be written,
    then the link refused)."""
    if link and os.path.lexists(link) and not os.path.islink(link):
        raise ConfigError(f"--publish {link!r} exists and is not a symlink; refusing to replace it")
    if link and os.path.islink(link) and os.path.exists(link):
        target = Path(link).resolve()
        if not (target / MANIFEST_FILE).is_file():
            raise ConfigError(
                f"--publish {link!r} is a symlink to {str(target)!r}, which is not a model "
                f"artifact (no {MANIFEST_FILE}); refusing to repoint a link we did not make"
            )
    if link and out is not None and Path(link).absolute() == Path(out).absolute():
        raise ConfigError(f"--publish {link!r} is --out itself: name a link beside it")


def publish(link: str, target: Path) -> None:
    """Atomically (re)point the symlink ``link`` at ``target``, by a path relative to the link.

    The new link is made as ``.LINK.tmp-HOST-PID-HEX`` (``staging_path``): one a killed
    publisher left is removed by the next write into that directory once its process is
    gone (``remove_stale_staging``), never a live publisher's. A link the file system
    refuses (full, read-only) raises ``WriteError`` and leaves the old link as it was."""
    link_path = Path(link).absolute()
    with writing("the --publish link", link_path):
        link_path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(link_path)
        destination = os.path.relpath(target.absolute(), link_path.parent)
        temporary = staging_path(link_path)
        os.symlink(destination, temporary)
        try:
            os.replace(temporary, link_path)
        except BaseException:
            os.unlink(temporary)
            raise
