"""Folder trees of any depth, walked and removed without recursion and without following symlinks.

A model-written program can make a tree thousands of folders deep; Python's os.fwalk and
shutil.rmtree recurse once per level (RecursionError) and a path to the bottom outgrows PATH_MAX.
Both walks here keep an explicit stack of folder fds opened O_NOFOLLOW relative to their parent."""

import os
import stat
from typing import Iterator, List, Tuple

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_OPEN = 200  # folder fds held at once by a walk


def _entries(fd: int) -> Tuple[List[str], List[str]]:
    """(sorted folder names, sorted other names) in the folder fd, symlinks counted as files."""
    dirs, files = [], []
    with os.scandir(fd) as it:
        for e in it:
            (dirs if e.is_dir(follow_symlinks=False) else files).append(e.name)
    return sorted(dirs), sorted(files)


def walk(dir_fd: int, max_depth: int = MAX_OPEN, skipped: list = None) -> Iterator[Tuple[List[str], int, List[str]]]:
    """Depth-first (folder components from dir_fd, folder fd, file names), folders in name order.
    Folders deeper than max_depth are not entered (their paths are appended to `skipped` when given).
    The yielded fd is valid until the next step."""
    top = os.dup(dir_fd)
    stack = []
    try:
        dirs, files = _entries(top)
        stack.append((top, [], iter(dirs)))
        yield [], top, files
        while stack:
            fd, at, todo = stack[-1]
            name = next(todo, None)
            if name is None:
                os.close(stack.pop()[0])
                continue
            if len(stack) > max_depth:
                if skipped is not None:
                    skipped.append(at + [name])
                continue
            try:
                child = os.open(name, DIR_FLAGS, dir_fd=fd)
            except OSError:
                continue
            try:
                dirs, files = _entries(child)
            except OSError:
                os.close(child)
                continue
            stack.append((child, at + [name], iter(dirs)))
            yield at + [name], child, files
    finally:
        for fd, _, _ in stack:
            os.close(fd)


def remove_tree(path: str):
    """Remove path and everything under it, at any depth; errors are ignored (best effort, like
    shutil.rmtree(ignore_errors=True)) but never a RecursionError."""
    try:
        top = os.open(path, DIR_FLAGS)
    except OSError:
        _unlink(path)
        return
    _empty(top)
    try:
        os.rmdir(path)
    except OSError:
        pass


def remove_at(dir_fd: int, name: str):
    """Remove the folder `name` in dir_fd and everything under it (never following a symlink);
    OSError when it could not be removed."""
    _empty(os.open(name, DIR_FLAGS, dir_fd=dir_fd))
    os.rmdir(name, dir_fd=dir_fd)


def _empty(top: int):
    """Remove everything in the folder fd `top` (closed on return). Folders deeper than MAX_OPEN are
    first moved up to the top folder, so the fds held stay bounded."""
    stack = [(top, None, None, set())]  # (fd, parent fd, name in parent, subfolders that would not go)
    hoisted = 0
    try:
        while stack:
            fd, parent, name, stuck = stack[-1]
            child = _next_subdir(fd, stuck)
            if child is None:
                stack.pop()
                os.close(fd)
                if parent is not None and not _rmdir(name, parent):
                    stack[-1][3].add(name)
                continue
            if len(stack) >= MAX_OPEN:  # move the deep folder to the top and remove it from there later
                hoisted += 1
                new = f".justfit-deep-{hoisted}-{os.urandom(3).hex()}"
                try:
                    os.rename(child, new, src_dir_fd=fd, dst_dir_fd=top)
                except OSError:
                    stuck.add(child)
                continue
            try:
                stack.append((os.open(child, DIR_FLAGS, dir_fd=fd), fd, child, set()))
            except OSError:
                stuck.add(child)
    finally:
        for fd, *_ in stack:
            os.close(fd)


def _next_subdir(fd: int, stuck: set):
    """Unlink every non-folder in fd; return the name of one remaining subfolder not in stuck, or None."""
    try:
        with os.scandir(fd) as it:
            entries = list(it)
    except OSError:
        return None
    sub = None
    for e in entries:
        try:
            is_dir = stat.S_ISDIR(os.lstat(e.name, dir_fd=fd).st_mode)
        except OSError:
            continue
        if not is_dir:
            try:
                os.unlink(e.name, dir_fd=fd)
            except OSError:
                pass
        elif sub is None and e.name not in stuck:
            sub = e.name
    return sub


def _rmdir(name: str, dir_fd: int) -> bool:
    try:
        os.rmdir(name, dir_fd=dir_fd)
        return True
    except OSError:
        return False


def _unlink(path: str):
    try:
        os.unlink(path)
    except OSError:
        pass
