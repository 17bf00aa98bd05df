"""Checkpoints appear whole or not at all: written beside their path, then committed in one step.

Both formats are written to a staging path in the target's own directory, ``<name>.tmp-<id>``
(:func:`staging`), never to ``$TMPDIR``: a rename is atomic only within one filesystem, and a move
from another one copies into the target, truncating it first. :func:`commit` then puts the staged
checkpoint at its path:

- a file: one ``os.replace``; at any moment the path holds the old file or the new one.
- a directory (a directory cannot replace a non-empty one in one step): ``path`` is renamed to
  ``<name>.old-<id>``, then ``<name>.tmp-<id>`` to ``path``. Between the two renames ``path`` is
  missing and both complete copies lie beside it; :func:`resolve` then finds the newest complete
  one and warns that it loads it instead.

Copies left by an interrupted save are removed by the next save that commits
(:func:`remove_leftovers`). Each step is flushed to disk (``fsync`` of the file and of the
directory) before the next.
"""

from __future__ import annotations

import glob
import os
import shutil
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path

__all__ = ["commit", "leftovers", "remove_leftovers", "resolve", "staging", "write_file"]


def staging(path: str | os.PathLike, tag: str | None = None) -> Path:
    """``<name>.tmp-<tag>`` beside ``path`` (``tag``: a fresh random one by default)."""
    path = Path(path)
    return path.with_name(f"{path.name}.tmp-{tag or uuid.uuid4().hex[:12]}")


def leftovers(path: str | os.PathLike) -> list[Path]:
    """The staged and replaced copies of ``path`` that lie beside it (``<name>.tmp-*``, ``<name>.old-*``)."""
    path = Path(path)
    pattern = os.path.join(glob.escape(str(path.parent)), glob.escape(path.name))
    return sorted(Path(p) for kind in ("tmp", "old") for p in glob.glob(f"{pattern}.{kind}-*"))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def remove_leftovers(path: str | os.PathLike, keep: Path | None = None) -> None:
    """Delete every leftover copy of ``path`` (:func:`leftovers`) but ``keep``."""
    for leftover in leftovers(path):
        if leftover != keep:
            _remove(leftover)


def _sync(path: Path) -> None:
    """Flush ``path`` (a file or a directory's entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(staged: Path, path: str | os.PathLike) -> None:
    """Put the complete ``staged`` file or directory at ``path`` (see the module's description), then
    remove the copies earlier saves left.

    Raises:
        OSError: a rename failed; ``path`` then holds the old checkpoint, or is missing with the
            old and the new complete copy beside it (:func:`resolve` finds them).
    """
    path = Path(path)
    _sync(staged)
    if staged.is_dir() and path.exists():
        os.replace(path, path.with_name(f"{path.name}.old-{staged.name.rsplit('.tmp-', 1)[1]}"))
    os.replace(staged, path)
    _sync(path.parent)
    remove_leftovers(path)


def write_file(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Write a file atomically: ``write(staged)`` beside ``path``, then :func:`commit`.

    Raises:
        Exception: whatever ``write`` or the commit raises; ``path`` then holds the old file
            (the staged one is removed, or by the next save).
    """
    staged = staging(path)
    try:
        write(staged)
        commit(staged, path)
    except Exception:
        _remove(staged)
        raise


def resolve(path: str | os.PathLike, complete: Callable[[Path], bool]) -> Path:
    """``path``, or where its checkpoint is when a save was interrupted between the two renames of
    :func:`commit`: the newest complete (``complete(copy)``) leftover copy, with a warning.

    ``path`` is returned as it is when it exists or no complete copy lies beside it.
    """
    path = Path(path)
    if path.exists():
        return path
    copies = sorted((c for c in leftovers(path) if complete(c)), key=lambda c: c.stat().st_mtime)
    if not copies:
        return path
    warnings.warn(
        f"{path} does not exist: a save was interrupted while it replaced the checkpoint there; loading "
        f"the complete copy beside it, {copies[-1]} (the next save removes such copies)",
        stacklevel=2,
    )
    return copies[-1]
