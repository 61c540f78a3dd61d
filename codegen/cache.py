"""On-disk kernel cache, keyed by a hash of (template, spec, target, versions).

Each entry is a folder ``<key>/`` holding the built library and ``meta.json`` with the
library's SHA-256; a hit whose file is missing, altered or unloadable is rebuilt.
``SPARTA_CACHE`` chooses the root (default ``~/.cache/sparta``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path


def cache_root() -> Path:
    root = Path(os.environ.get("SPARTA_CACHE", Path.home() / ".cache" / "sparta"))
    root.mkdir(parents=True, exist_ok=True)
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
    """The cached file if present and intact, else None (a corrupt entry is removed)."""
    entry = cache_root() / key
    path, meta = entry / filename, entry / "meta.json"
    if not path.is_file() or not meta.is_file():
        return None
    try:
        ok = json.loads(meta.read_text()).get("sha256") == file_digest(path)
    except (OSError, ValueError):
        ok = False
    if not ok:
        shutil.rmtree(entry, ignore_errors=True)
        return None
    return path


def store(key: str, filename: str, write, info: dict) -> Path:
    """Write an entry atomically: ``write(path)`` produces the file, then meta.json records its hash."""
    entry = cache_root() / key
    tmp = cache_root() / f".{key}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp / filename)
    (tmp / "meta.json").write_text(json.dumps({**info, "sha256": file_digest(tmp / filename)}, indent=1))
    shutil.rmtree(entry, ignore_errors=True)
    os.replace(tmp, entry)
    return entry / filename


def invalidate(key: str) -> None:
    shutil.rmtree(cache_root() / key, ignore_errors=True)
