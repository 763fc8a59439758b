"""Copy a tool call's workspace changes back from its overlay's upper layer.

Inside the sandbox the workspace is an overlay: the real folder below, read-only, and a size-capped
tmpfs above that takes every write, so the call's writes have a total (the tmpfs size). When the call
has ended (every process of it dead), the launcher applies the upper layer to the real folder: new and
changed files are written (temp file + rename, never through a symlink or hard link), whiteouts remove,
opaque folders replace. Every step is relative to a folder fd opened O_NOFOLLOW, so nothing the program
left in the workspace can redirect a write outside it.

No relative imports: the launcher (confine.py) loads this file as a top-level module.
"""

import errno
import os
import stat

import trees

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
OPAQUE = (b"trusted.overlay.opaque", b"user.overlay.opaque")


def _opaque(dir_fd: int, name: str) -> bool:
    path = f"/proc/self/fd/{dir_fd}/{name}"
    for attr in OPAQUE:
        try:
            if os.getxattr(path, attr, follow_symlinks=False) == b"y":
                return True
        except OSError:
            pass
    return False


def _kind(dir_fd: int, name: str):
    try:
        return stat.S_IFMT(os.lstat(name, dir_fd=dir_fd).st_mode)
    except FileNotFoundError:
        return None


def _remove(dir_fd: int, name: str):
    kind = _kind(dir_fd, name)
    if kind == stat.S_IFDIR:
        trees.remove_at(dir_fd, name)
    elif kind is not None:
        os.unlink(name, dir_fd=dir_fd)


def _tmp_name(name: str) -> str:
    return f".{name[:40]}.{os.urandom(4).hex()}.copyback"


def _copy_file(ufd: int, wfd: int, name: str, mode: int):
    src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=ufd)
    tmp = _tmp_name(name)
    try:
        dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode & 0o777, dir_fd=wfd)
        try:
            while True:
                chunk = os.read(src, 1 << 20)
                if not chunk:
                    break
                os.write(dst, chunk)
            os.fchmod(dst, mode & 0o777)
        finally:
            os.close(dst)
        if _kind(wfd, name) == stat.S_IFDIR:
            trees.remove_at(wfd, name)
        os.replace(tmp, name, src_dir_fd=wfd, dst_dir_fd=wfd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=wfd)
        except OSError:
            pass
        raise
    finally:
        os.close(src)


def _copy_link(ufd: int, wfd: int, name: str):
    tmp = _tmp_name(name)
    os.symlink(os.readlink(name, dir_fd=ufd), tmp, dir_fd=wfd)
    if _kind(wfd, name) == stat.S_IFDIR:
        trees.remove_at(wfd, name)
    os.replace(tmp, name, src_dir_fd=wfd, dst_dir_fd=wfd)


def _enter_dir(ufd: int, wfd: int, name: str, mode: int):
    """(upper fd, workspace fd) of the folder `name`, made or replaced in the workspace as needed."""
    if _opaque(ufd, name) or _kind(wfd, name) not in (stat.S_IFDIR, None):
        _remove(wfd, name)
    if _kind(wfd, name) is None:
        os.mkdir(name, mode & 0o777, dir_fd=wfd)
    cu = os.open(name, DIR_FLAGS, dir_fd=ufd)
    try:
        return cu, os.open(name, DIR_FLAGS, dir_fd=wfd)
    except BaseException:
        os.close(cu)
        raise


def apply(upper: str, workspace: str) -> list:
    """Apply the upper layer at `upper` to `workspace`; the problems met (one line each, at most 20)."""
    problems = []
    stack = [(os.open(upper, DIR_FLAGS), os.open(workspace, DIR_FLAGS), "")]
    try:
        while stack:
            ufd, wfd, at = stack.pop()
            try:
                with os.scandir(ufd) as it:
                    names = sorted(e.name for e in it)
                for name in names:
                    try:
                        st = os.lstat(name, dir_fd=ufd)
                        if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:  # whiteout: deleted in the call
                            _remove(wfd, name)
                        elif stat.S_ISDIR(st.st_mode):
                            cu, cw = _enter_dir(ufd, wfd, name, st.st_mode)
                            stack.append((cu, cw, at + name + "/"))
                        elif stat.S_ISREG(st.st_mode):
                            _copy_file(ufd, wfd, name, st.st_mode)
                        elif stat.S_ISLNK(st.st_mode):
                            _copy_link(ufd, wfd, name)
                    except OSError as e:
                        if len(problems) < 20:
                            problems.append(f"{at}{name}: {e.strerror or e}")
            finally:
                os.close(ufd)
                os.close(wfd)
    finally:
        for ufd, wfd, _ in stack:
            os.close(ufd)
            os.close(wfd)
    return problems


def mount_options(lower: str, upper: str, work: str, unprivileged: bool) -> str:
    """overlayfs options: no redirects or metacopy (the upper layer then holds plain files and folders),
    user.* xattrs in a user namespace. OSError for a path overlayfs cannot take."""
    for p in (lower, upper, work):
        if any(c in p for c in ",:\\\n"):
            raise OSError(errno.EINVAL, f"the workspace path {p!r} holds a ',', ':' or '\\' overlayfs cannot take")
    opts = f"lowerdir={lower},upperdir={upper},workdir={work},redirect_dir=nofollow,metacopy=off,index=off"
    return opts + (",userxattr" if unprivileged else "")
