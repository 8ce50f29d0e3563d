"""Atomic checkpoint directories: write into ``<path>.tmp``, then publish it as ``<path>``.

[Note: atomic saves]
All ranks write into ``<path>.tmp``; DCP writes ``.metadata`` last, after every rank's
data. Only then does rank 0 move the previous checkpoint to ``<path>.old``, rename
``<path>.tmp`` to ``<path>`` and delete ``<path>.old``. A crash before the renames leaves
``<path>`` untouched; a crash between them leaves ``<path>.old``, which loading falls
back to and the next save restores. ``<path>`` on a shared file system is assumed.
"""

from __future__ import annotations

import os
import shutil


def prepare(path: str, tmp: str) -> None:
    """Make an empty ``tmp`` to write into; finish or clean up an interrupted save first.
    Refuses to later replace a ``path`` that is not a checkpoint directory."""
    old = path + ".old"
    if not os.path.exists(path) and os.path.isdir(old):
        os.rename(old, path)  # a save was killed between its two renames: restore
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(path) and not _is_replaceable(path):
        raise FileExistsError(f"{path} exists and is not a checkpoint: refusing to replace it")
    shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted save
    os.makedirs(tmp)


def publish(tmp: str, path: str) -> None:
    """Replace ``path`` by the complete ``tmp`` (two renames, then the old one removed)."""
    old = path + ".old"
    if os.path.exists(path):
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    shutil.rmtree(old, ignore_errors=True)


def committed(path: str) -> str | None:
    """The directory holding the last published checkpoint at ``path``, or None."""
    if os.path.isdir(path):
        return path
    if os.path.isdir(path + ".old"):  # a save was killed between its two renames
        return path + ".old"
    return None


def _is_replaceable(path: str) -> bool:
    return os.path.isdir(path) and (
        not os.listdir(path) or os.path.exists(os.path.join(path, ".metadata"))
    )


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
