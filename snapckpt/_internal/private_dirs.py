"""Owner-only directories in shared places (``/tmp``, ``/dev/shm``): the one check every job directory
of snapckpt goes through (runtime directory, lock directory, arena directory)."""
from __future__ import annotations

import os
import stat

from snapckpt.errors import PersisterError

__all__ = ["private_dir"]


def private_dir(path: str) -> None:
    """Create ``path`` (mode ``0o700``) or check an existing one: a real directory (not a symbolic link)
    owned by this user, then made ``0o700``. The job's directories live in shared, world-writable places
    (``/tmp``, ``/dev/shm``) under predictable names: a directory or link planted there by another user
    must never be adopted (its files would be readable, or files elsewhere deleted at exit).

    Raises:
        PersisterError: ``path`` is a symbolic link, not a directory, or owned by another user.
    """
    parent = os.path.dirname(path)
    if parent and not os.path.isdir(parent):
        os.makedirs(parent, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise PersisterError(f"{path} is {'a symbolic link' if stat.S_ISLNK(st.st_mode) else 'not a directory'}, "
                             "not a private directory of this user; remove it or set runtime_dir=/shm_dir= (or "
                             "SNAPCKPT_RUNTIME_DIR/SNAPCKPT_SHM_DIR) to a private directory")
    if st.st_uid != os.getuid():
        raise PersisterError(f"{path} belongs to uid {st.st_uid}, not to this user; remove it or set "
                             "runtime_dir=/shm_dir= (or SNAPCKPT_RUNTIME_DIR/SNAPCKPT_SHM_DIR) to a private directory")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
