"""On-disk kernel cache, keyed by a hash of (template, spec, target, versions).

Each entry is a folder ``<key>/`` holding the built library and ``meta.json`` with the
library's SHA-256; a hit whose file is missing or altered counts as a miss and is rebuilt.
``SPARTA_CACHE`` chooses the root (default ``~/.cache/sparta``).

Entries are published atomically: written into a temporary folder in the root, then renamed
into place. Two processes storing one key both succeed; the second finds the first's entry
(a lost race is a hit). Replacing a broken entry happens under a lock on the root.

The cache holds native code that sparta loads as it finds it (the SHA-256 guards against
corruption, not tampering), so the root must be the user's own: it is created ``0700`` and
refused when another user owns it or group or others may write to it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

from ..errors import CodegenError

STALE_S = 24 * 3600          # a temporary folder this old belongs to a crashed store


def cache_root() -> Path:
    """The cache folder (created ``0700``); refused unless this user owns it and only they may write to it."""
    root = Path(os.environ.get("SPARTA_CACHE") or Path.home() / ".cache" / "sparta")
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        root.mkdir(mode=0o700, exist_ok=True)
        info = root.stat()
    except OSError as exc:
        raise CodegenError(f"kernel cache {root} cannot be created: {exc}") from exc
    if info.st_uid != os.getuid():
        raise CodegenError(f"kernel cache {root} belongs to another user; sparta loads native code from it, "
                           "so it must be yours (set SPARTA_CACHE to a folder of your own)")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CodegenError(f"kernel cache {root} is writable by group or others (mode {stat.filemode(info.st_mode)}); "
                           f"sparta loads native code from it: chmod go-w {root}")
    return root


def cache_key(payload: dict) -> str:
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def lookup(key: str, filename: str) -> Path | None:
    """The cached file if present and intact, else None."""
    path = cache_root() / key / filename
    try:
        ok = json.loads((path.parent / "meta.json").read_text())["sha256"] == file_digest(path)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return path if ok else None


def store(key: str, filename: str, write, info: dict) -> Path:
    """Publish an entry: ``write(path)`` produces the file, meta.json records its hash, a rename
    publishes both. An intact entry already there (another process's) wins and is returned."""
    root = cache_root()
    _sweep(root)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", suffix=".tmp", dir=root))
    try:
        write(tmp / filename)
        (tmp / "meta.json").write_text(json.dumps({**info, "sha256": file_digest(tmp / filename)}, indent=1))
        if _publish(tmp, root / key):
            return root / key / filename
        with _locked(root):                      # the key exists: a lost race (a hit) or a broken entry
            while True:                          # (a lock-free publish may land between discard and rename)
                hit = lookup(key, filename)
                if hit is not None:
                    return hit
                _discard(root, key)
                if _publish(tmp, root / key):
                    return root / key / filename
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def invalidate(key: str) -> None:
    """Remove an entry that is intact on disk but unusable (e.g. a library the runtime cannot load)."""
    root = cache_root()
    with _locked(root):
        _discard(root, key)


def _publish(tmp: Path, entry: Path) -> bool:
    try:
        os.rename(tmp, entry)
        return True
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            return False
        raise


def _discard(root: Path, key: str) -> None:
    """Move an entry aside (one rename: readers see it or nothing), then delete it. Call under the lock."""
    trash = Path(tempfile.mkdtemp(prefix=f".{key}.", suffix=".old", dir=root))
    try:
        os.rename(root / key, trash / key)
    except FileNotFoundError:
        pass
    shutil.rmtree(trash, ignore_errors=True)


@contextlib.contextmanager
def _locked(root: Path):
    fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _sweep(root: Path) -> None:
    """Delete temporary folders that crashed stores left behind (older than :data:`STALE_S`)."""
    now = time.time()
    with contextlib.suppress(OSError), os.scandir(root) as entries:
        for e in entries:
            if e.name.startswith(".") and e.name.endswith((".tmp", ".old")) and \
                    now - e.stat(follow_symlinks=False).st_mtime > STALE_S:
                shutil.rmtree(e.path, ignore_errors=True)
