"""Atomic file writes: a reader (or a crash) sees a file's old content or its new content, never a part."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def atomic_write(path: str | Path, data: str | bytes, durable: bool = True) -> None:
    """Write `data` (str as UTF-8) to `path` through a temporary file in the same directory renamed over it.

    `durable` also fsyncs the file before the rename and the directory after it, so the new content survives
    a power loss or an OS crash, not only a killed process. That costs ~8 ms a write on an ext4 disk:
    pass `durable=False` for files on a hot path that a crash may lose (a killed process never loses them).

    Example:
        >>> atomic_write("/tmp/masgraph-doc-state.json", '{"step": 3}')
        >>> Path("/tmp/masgraph-doc-state.json").read_text()
        '{"step": 3}'
    """
    path = Path(path)
    # unique per process and thread, so two writers of one file never share a temporary file
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable (a no-op where directories cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a directory; the rename is still atomic
    finally:
        os.close(fd)


@contextmanager
def building_dir(out: str | Path, prefix: str) -> Iterator[Path]:
    """A fresh hidden directory beside `out` to build into; when the block ends it becomes `out` in one rename
    (unless another process finished `out` first: then it is dropped), and when the block fails it is removed.
    So `out` is either absent or complete, whoever builds it and however the build stops."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=out.parent))
    try:
        yield tmp
        tmp.chmod(0o755)
        if out.exists():  # another process finished first
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
