"""What a writer of an artifact may replace.

A rule keeps a user's data safe from the commands that write artifacts (the training job,
``references add|remove|condense``, ``nca-index``):

* **Only what we wrote is replaced.** A path is replaceable when it does not exist, is an
  empty directory, or is an artifact directory: its ``manifest.json`` says it is of this
  format, and every entry in it is a file the manifest names (its arrays, index and extras)
  or ``report.html``, the page the training job renders there. Anything else (a directory
  of the user's data, a file, a symlink, an artifact the user put a notes file into) is
  refused before any work: :func:`check_replaceable` raises an ``ArtifactError`` that
  names the path and the entry that is not ours.
"""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path

from service.core.artifact.format import FORMAT_NAME, INDEX_FILE, MANIFEST_FILE, ArtifactError

# written into an artifact directory after the artifact by the training job (report_page.py)
PAGES_BESIDE_ARTIFACT = frozenset({"report.html"})
# the page's temporary file while it is written (left by a writer killed in the middle)
_PARTIAL_PAGE = re.compile(r"\.report\.html\.[0-9]+\.partial")


def _owned_names(manifest: dict) -> set[str]:
    """The entries an artifact directory may hold: the manifest, the files it lists (arrays
    by their ``path``, the index) and its extras, and the report page."""
    names = {MANIFEST_FILE, INDEX_FILE, *PAGES_BESIDE_ARTIFACT}
    files = manifest.get("files")
    if isinstance(files, dict):
        names.update(r["path"] for r in files.values() if isinstance(r, dict) and "path" in r)
    extras = manifest.get("extras")
    if isinstance(extras, dict):
        names.update(str(name) for name in extras)
    return names


def _manifest_of(directory: Path) -> dict | None:
    """The parsed manifest when ``directory`` holds one of this format, else None."""
    try:
        text = (directory / MANIFEST_FILE).read_text(encoding="utf-8")
        manifest = json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        return None
    return manifest


def check_replaceable(path: str | os.PathLike, option: str = "--out") -> None:
    """Raise ``ArtifactError`` unless ``path`` is absent, an empty directory, or an artifact
    directory holding nothing but its own files (see the module's docstring). The message
    names ``option``, the path and what was found there."""
    target = Path(path)
    where = f"{option} {str(path)!r}"
    if target.is_symlink():
        raise ArtifactError(
            f"{where} is a symbolic link; refusing to replace it (give the directory it "
            "points to, or use --publish for a link to the new version)"
        )
    if not target.exists():
        parent = target.parent
        for ancestor in (parent, *parent.parents):
            if ancestor.exists():
                if not ancestor.is_dir():
                    raise ArtifactError(f"{where}: {str(ancestor)!r} is not a directory")
                break
        return
    if not target.is_dir():
        raise ArtifactError(
            f"{where} exists and is not a directory; refusing to replace a file we did not write"
        )
    try:
        entries = sorted(entry.name for entry in target.iterdir())
    except OSError as exc:
        raise ArtifactError(f"{where}: cannot list it ({exc.strerror or exc})") from None
    if not entries:
        return
    manifest = _manifest_of(target)
    if manifest is None:
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise ArtifactError(
            f"{where} exists and is not an artifact (no {FORMAT_NAME} manifest.json; it holds "
            f"{shown}); refusing to replace it: choose a new or empty directory"
        )
    owned = _owned_names(manifest)
    foreign = [n for n in entries if n not in owned and not _PARTIAL_PAGE.fullmatch(n)]
    if foreign:
        raise ArtifactError(
            f"{where} is an artifact that also holds {foreign[:3]} which the artifact does not "
            "list; refusing to replace it and lose them: move them out first"
        )


def check_writable(path: str | os.PathLike) -> None:
    """Raise ``OSError`` (errno EROFS or EACCES, ``filename`` the path) when the directory
    that will hold ``path`` (its nearest existing ancestor) cannot take new entries: a writer
    learns it before its work, not after."""
    target = Path(path).absolute()
    ancestor = target.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if os.access(ancestor, os.W_OK | os.X_OK):
        return
    try:
        read_only = bool(os.statvfs(ancestor).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    code = errno.EROFS if read_only else errno.EACCES
    raise OSError(code, os.strerror(code), str(target))
