"""Publishing an artifact: atomically pointing a symlink (``--publish``) at a new artifact
directory, for the training job and the references command alike.

A server polling the link (``service`` with ``reload_poll_seconds``) sees either the old
target or the new one, never a half-made link: the new link is made under a temporary name
beside the old one and renamed over it (``rename(2)`` replaces a symlink atomically).
"""

from __future__ import annotations

import os
from pathlib import Path

from training.errors import ConfigError


def check_publish_link(link: str | None) -> None:
    """ConfigError when ``link`` exists and is not a symlink (it is never replaced)."""
    if link and os.path.lexists(link) and not os.path.islink(link):
        raise ConfigError(f"--publish {link!r} exists and is not a symlink; refusing to replace it")


def publish(link: str, target: Path) -> None:
    """Atomically (re)point the symlink ``link`` at ``target``, by a path relative to the link."""
    link_path = Path(link).absolute()
    link_path.parent.mkdir(parents=True, exist_ok=True)
    destination = os.path.relpath(target.absolute(), link_path.parent)
    temporary = link_path.with_name(f".{link_path.name}.tmp-{os.getpid()}")
    if os.path.lexists(temporary):
        os.unlink(temporary)
    os.symlink(destination, temporary)
    os.replace(temporary, link_path)
