"""Writing a saved model's folder so that no save loses data, even when killed half-way.

A save is written into a temporary folder beside its destination (``.<name>.sparta-new.<id>``)
and published by rename. An earlier save is replaced by swapping the two folders in one
``renameat2(RENAME_EXCHANGE)``; where the file system lacks it, in two renames (the old save
moved aside to ``.<name>.sparta-old.<id>``, the new one moved in), and a crash between them
is undone by the next save or load of that path, which moves the old save back. The old copy
is deleted only once the new one is in place.

Each temporary folder is ``flock``-ed by the process writing it, so a later save can tell a
crashed save's leftovers (lock free: deleted) from a running one's (locked: left alone).
Only a folder that is empty or an earlier save whose every file its manifest lists is ever
replaced: nothing else of the user's is deleted.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import shutil
import uuid
from pathlib import Path

from .saved_checks import MANIFEST, SavedModelError, folder_entries, is_sparta_manifest, parse_manifest

_RENAME_EXCHANGE = 2
_KINDS = ("new", "old", "trash")


def check_destination(dest: Path) -> None:
    """Refuse ``dest`` unless it is absent, an empty folder, or an earlier save holding nothing else."""
    if dest.is_symlink():
        raise SavedModelError(f"{dest} is a symbolic link; save to the folder it points to")
    if not dest.exists():
        return
    if not dest.is_dir():
        raise SavedModelError(f"{dest} exists and is not a folder; choose an empty or new folder")
    if not any(dest.iterdir()):
        return
    files, folders = folder_entries(dest)
    manifest = parse_manifest(dest) if MANIFEST in files else None
    if not is_sparta_manifest(manifest):
        raise SavedModelError(f"{dest} exists and is not a saved sparta model; choose an empty or new folder")
    listed = set(manifest["files"])
    needed = {p.as_posix() for rel in listed for p in Path(rel).parents if p != Path(".")} | {"kernels"}
    extra = sorted((files - listed - {MANIFEST}) | (folders - needed))
    if extra:
        raise SavedModelError(f"{dest} holds {extra[0]}, which is not part of the saved sparta model there; "
                              "move it away or choose another folder")


class TempFolder:
    """A locked temporary folder beside ``dest``: ``with TempFolder(dest) as tmp: ...; tmp.publish()``."""

    def __init__(self, dest: Path):
        self.dest = dest
        while True:
            self.path = _temp_name(dest, "new")
            self.path.mkdir()
            self._fd = _lock(self.path)
            if os.path.samestat(os.fstat(self._fd), os.stat(self.path, follow_symlinks=False)):
                break
            os.close(self._fd)                        # a cleaner took it before the lock: another name

    def __enter__(self) -> TempFolder:
        return self

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self.path, ignore_errors=True)   # a failed save, or the old save after a swap
        os.close(self._fd)

    def publish(self) -> None:
        """Move the finished folder to ``dest``, replacing an earlier save there atomically."""
        _sync_tree(self.path)
        try:
            os.rename(self.path, self.dest)           # no save there yet (or an empty folder)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            check_destination(self.dest)
            if not _exchange(self.path, self.dest):
                self._replace_in_two_steps()
        _fsync_dir(self.dest.parent)

    def _replace_in_two_steps(self) -> None:
        old = _temp_name(self.dest, "old")
        fd = _lock(self.dest)                         # locked while aside: no recovery takes it back meanwhile
        try:
            os.rename(self.dest, old)
            try:
                os.rename(self.path, self.dest)
            except OSError:
                os.rename(old, self.dest)
                raise
            os.rename(old, self.path)                 # what __exit__ deletes
        finally:
            os.close(fd)


def recover(dest: Path) -> None:
    """Undo a save killed between the two renames of a replacement: move the old save back."""
    if not (dest.exists() or dest.is_symlink()):
        _take_leftovers(dest, "old", lambda path: os.rename(path, dest), first=True)


def clean(dest: Path) -> None:
    """Delete temporary folders of ``dest`` that no running save holds."""
    trash = []

    def discard(path: Path) -> None:              # renamed first: a half-deleted folder never looks like a save
        trash.append(_temp_name(dest, "trash"))
        os.rename(path, trash[-1])

    for kind in _KINDS:
        if kind != "old" or dest.exists():        # without dest, recover() still needs the old save
            _take_leftovers(dest, kind, discard)
    for path in trash:
        shutil.rmtree(path, ignore_errors=True)


def _take_leftovers(dest: Path, kind: str, act, first: bool = False) -> None:
    """``act(path)`` on each temporary folder of ``dest`` of ``kind`` whose writer is gone (its lock is
    free), holding the lock meanwhile; with ``first``, stop after one that succeeds."""
    prefix = f".{dest.name}.sparta-{kind}."
    try:
        names = sorted(e.name for e in os.scandir(dest.parent) if e.name.startswith(prefix))
    except OSError:
        return
    for name in names:
        try:
            fd = os.open(dest.parent / name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # raises while a running save holds it
            act(dest.parent / name)
            if first:
                return
        except OSError:
            pass
        finally:
            os.close(fd)


def _temp_name(dest: Path, kind: str) -> Path:
    return dest.parent / f".{dest.name}.sparta-{kind}.{uuid.uuid4().hex[:12]}"


def _lock(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2``); False where the system or file system cannot."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _sync_tree(root: Path) -> None:
    """Flush a folder's files and directories to disk before it is published."""
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(folder))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["check_destination", "TempFolder", "recover", "clean"]
