"""Walking an image folder: symbolic links to folders followed, each real folder listed once, no loops.

A data set is often a tree of class folders some of which are links (``cats -> /mnt/photos/cats``). ``os.walk``
lists such a link but never enters it, so its images were left out without a word. Here a linked folder is entered,
under the name of the link (it names the class); a link that leads to a folder already listed (an ancestor: a loop;
or another class's folder: the same images twice) is not entered, and the walk says so once, in a notice.

The real tree is walked first and the linked folders after it, so a folder reached both directly and through a link
is listed under its own path. A leaf: the standard library only (the gallery listing and the data sets share it).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

NAMED_REPEATS = 3  # linked folders named in the notice; the rest are counted


@dataclass
class FolderWalk:
    """``os.walk(root)`` top-down in sorted order, following folder links with loop protection (see the module)."""

    root: str
    onerror: Callable[[OSError], None] | None = None
    within: bool = False  # enter only linked folders that resolve inside root (a gallery a server will send)
    repeated: list[tuple[str, str]] = field(default_factory=list)  # (link, the folder it leads to), the first few
    repeats: int = 0  # links not entered: their folder was listed already
    outside: list[tuple[str, str]] = field(default_factory=list)  # (link, its folder): not entered, the first few
    outsiders: int = 0  # links not entered: their folder lies outside root (``within``)

    def __iter__(self) -> Iterator[tuple[str, list[str], list[str]]]:
        """(folder, sub-folder names, other names) per folder listed; editing the sub-folders prunes as os.walk."""
        seen: set[tuple[int, int]] = set()
        start = self._identity(self.root)
        if start is None:
            return
        seen.add(start)
        links: list[str] = []  # linked folders met, entered once the real tree is done
        stack = [self.root]
        # each folder is pushed once: its identity enters `seen` first, so the walk ends (bounded by real folders)
        while stack or links:
            if not stack:
                link = links.pop(0)
                identity = self._identity(link)
                if identity is None:
                    continue
                if identity in seen:
                    self._repeat(link)
                    continue
                if self.within and not self._inside(link):
                    self.outsiders += 1
                    if len(self.outside) < NAMED_REPEATS:
                        self.outside.append((link, os.path.realpath(link)))
                    continue
                seen.add(identity)
                stack.append(link)
            folder = stack.pop()
            listed = self._list(folder)
            if listed is None:
                continue
            dirs, linked, files = listed
            everything = sorted(dirs + linked)
            yield folder, everything, files
            kept = set(everything)  # the caller may have pruned
            for name in reversed(sorted(dirs)):  # popped in sorted order
                path = os.path.join(folder, name)
                identity = self._identity(path)
                if name in kept and identity is not None and identity not in seen:
                    seen.add(identity)
                    stack.append(path)
            links.extend(os.path.join(folder, name) for name in sorted(linked) if name in kept)
        if self.repeats:
            shown = "; ".join(f"{link} -> {target}" for link, target in self.repeated)
            more = f" and {self.repeats - len(self.repeated)} more" if self.repeats > len(self.repeated) else ""
            logger.warning("%d linked folder(s) under %s lead to a folder listed already, so their images are listed "
                           "once, under that folder (%s%s)", self.repeats, self.root, shown, more)
        if self.outsiders:
            shown = "; ".join(f"{link} -> {target}" for link, target in self.outside)
            more = f" and {self.outsiders - len(self.outside)} more" if self.outsiders > len(self.outside) else ""
            logger.warning("%d linked folder(s) under %s lead outside it and were not followed: a server sends every "
                           "catalogued file to whoever searches (%s%s); move those folders into %s, or index them "
                           "from their own place", self.outsiders, self.root, shown, more, self.root)

    def _inside(self, link: str) -> bool:
        """Whether the folder ``link`` leads to lies inside the real root."""
        root, target = os.path.realpath(self.root), os.path.realpath(link)
        return target == root or target.startswith(root.rstrip(os.sep) + os.sep)

    def _identity(self, path: str) -> tuple[int, int] | None:
        """The real folder's (device, inode); None (said through ``onerror``) when it cannot be read."""
        try:
            info = os.stat(path)
        except OSError as exc:
            if self.onerror is not None:
                self.onerror(exc)
            return None
        return info.st_dev, info.st_ino

    def _list(self, folder: str) -> tuple[list[str], list[str], list[str]] | None:
        """(real sub-folders, linked sub-folders, other names) of ``folder``; None when it cannot be listed."""
        dirs, linked, files = [], [], []
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            dirs.append(entry.name)
                        elif entry.is_symlink() and entry.is_dir():  # a link to a folder (a broken one is a name)
                            linked.append(entry.name)
                        else:
                            files.append(entry.name)
                    except OSError:
                        files.append(entry.name)  # as os.walk: what cannot be told a folder is a name
        except OSError as exc:
            if self.onerror is not None:
                self.onerror(exc)
            return None
        return sorted(dirs), sorted(linked), sorted(files)

    def _repeat(self, link: str) -> None:
        self.repeats += 1
        if len(self.repeated) < NAMED_REPEATS:
            self.repeated.append((link, os.path.realpath(link)))


def walk_following_links(root: str | os.PathLike[str], onerror: Callable[[OSError], None] | None = None,
                         within: bool = False) -> FolderWalk:
    """The walk of ``root`` (a folder): every real folder once, linked folders entered (with ``within``, only those
    that resolve inside ``root``), in a deterministic order."""
    return FolderWalk(os.fspath(root), onerror, within)
