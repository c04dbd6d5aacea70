"""Files and folders that two processes may write at once (the cache: converted GGUFs, cost
profiles; training's features and checkpoints), written so that a reader only ever sees a whole
one and two writers never share a half-written one.

Each writer fills a temporary sibling of its own (`NAME.tmp-HOST-PID-RANDOM`) and renames it into
place. For a file the last rename wins, whole; for a folder the first rename wins and a later
writer finds the folder there, drops its own copy and counts that as success (both wrote the
same content). A temporary left by a killed writer is removed by the next writer of that name
once its owner is gone: the pid is checked on this host, and a temporary from another host (a
shared cache folder) or without an owner (older eagle2 wrote `NAME.tmp`) only after a day.
"""
from __future__ import annotations

import errno
import os
import shutil
import socket
import time
import uuid

STALE_S = 24 * 3600  # a temporary whose owner cannot be checked is someone's after this long


def _host() -> str:
    return socket.gethostname().replace("-", "_")[:32] or "host"


def temp_sibling(path: str) -> str:
    """A fresh temporary name beside `path`, owned by this process."""
    return f"{path}.tmp-{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _owner_gone(name: str, prefix: str, mtime: float) -> bool:
    """Whether the temporary `name` (beside a final `prefix`) belongs to no live writer."""
    parts = name[len(prefix):].split("-")
    if len(parts) == 4 and parts[0] == "tmp" and parts[2].isdigit():
        if parts[1] == _host():
            return int(parts[2]) != os.getpid() and not _alive(int(parts[2]))
    return time.time() - mtime > STALE_S


def clean_stale(path: str) -> int:
    """Remove temporaries beside `path` whose writers are gone; returns how many."""
    folder, base = os.path.split(os.path.abspath(path))
    prefix = base + "."
    removed = 0
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(prefix + "tmp"):
            continue
        full = os.path.join(folder, name)
        try:
            if not _owner_gone(name, prefix, os.lstat(full).st_mtime):
                continue
            shutil.rmtree(full) if os.path.isdir(full) and not os.path.islink(full) else os.unlink(full)
            removed += 1
        except OSError:
            pass  # someone else cleaned it, or it is not ours to remove: it only holds space
    return removed


def replace_with(path: str, write) -> None:
    """`write(tmp_path)` fills a temporary file, which then replaces `path` in one rename (for
    writers that take a path: safetensors, torch.save); on any failure no temporary is left."""
    tmp = temp_sibling(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_bytes(path: str, data: bytes, sync: bool = False) -> None:
    """`path` replaced by `data` in one rename (`sync`: on disk before the rename)."""
    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
    replace_with(path, write)


def write_text(path: str, text: str, sync: bool = False) -> None:
    write_bytes(path, text.encode("utf-8"), sync)


def publish_dir(tmp: str, final: str) -> bool:
    """Rename the finished folder `tmp` to `final`. True if ours is the one in place, False if
    another writer's already was (ours is removed). Other OSErrors propagate, `tmp` removed."""
    try:
        os.rename(tmp, final)
        return True
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY) or os.path.isdir(final):
            return False
        raise
