"""Publishing a checkpoint directory as a whole, for the trainer integrations.

The Hugging Face Trainer and accelerate write a checkpoint's files into its directory in
place, one after another: a save that stops half way leaves new weights beside the
previous optimizer state, or a directory without optimizer state.  The integrations
instead let the framework write into a hidden staging directory beside the checkpoint
(`staging_path`), then `commit_directory` publishes it by two renames, and
`recover_directory` (run by the next save or load) undoes what an interrupted commit left.
Local filesystems only (the frameworks' own files are local).
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
import uuid

from jaxguard.format.storage import fsync_dir, fsync_tree


# A checkpoint directory is committed as a whole: the framework writes it into a hidden
# staging directory beside it, and two renames publish it (the previous directory, if any,
# moved aside first and removed last).  A kill before the renames leaves the previous
# checkpoint as it was; a kill between them leaves it aside, and `recover_directory` (run by
# the next save or load) moves it back.  Every save has its own token in these names, so two
# jobs saving to one place never write into each other's stage: the last to publish wins,
# whole, and the other one's rename fails.
STAGING_SUFFIX = ".jaxguard-staging"
OLD_SUFFIX = ".jaxguard-old"
_AUX = re.compile(r"\.(?P<name>.+)\.(?P<token>[0-9a-f]{12})(?P<suffix>\.jaxguard-staging|\.jaxguard-old)")


def new_token() -> str:
    """A fresh token naming one save's staging and aside directories (12 hex digits)."""
    return uuid.uuid4().hex[:12]


def _aux(final: str, token: str, suffix: str) -> str:
    final = os.path.normpath(os.fspath(final))
    return os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.{token}{suffix}")


def staging_path(final: str, token: str) -> str:
    """The hidden staging directory of one save of `final` (``parent/.NAME.TOKEN.jaxguard-staging``).

    Args:
      final: the checkpoint directory a save publishes.
      token: the save's `new_token` (the same on every rank of the job).

    Returns:
      The staging path (no checkpoint-naming pattern matches it: it starts with a dot).
    """
    return _aux(final, token, STAGING_SUFFIX)


def _age(path: str) -> float:
    """Seconds since anything directly in `path` (or `path` itself) was last modified."""
    newest = os.stat(path).st_mtime
    with contextlib.suppress(OSError):
        for entry in os.scandir(path):
            with contextlib.suppress(OSError):
                newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
    return time.time() - newest


def recover_directory(final: str) -> list:
    """Undo what interrupted commits of `final` left; the previous checkpoint comes back.

    A directory moved aside by a commit that stopped before publishing is renamed back
    (the newest, when several); aside directories of commits that published are removed;
    staging directories unmodified for `jaxguard.format.storage.STALE_TMP_SECONDS` are
    removed, younger ones (a save that stopped, or one still running in another job) named.

    Args:
      final: a checkpoint directory `commit_directory` publishes.

    Returns:
      One-line descriptions of what was restored, removed or left.
    """
    from jaxguard.format.storage import STALE_TMP_SECONDS
    final = os.path.normpath(os.fspath(final))
    parent, name = os.path.dirname(final) or ".", os.path.basename(final)
    found = {OLD_SUFFIX: [], STAGING_SUFFIX: []}
    with contextlib.suppress(OSError):
        for entry in os.scandir(parent):
            m = _AUX.fullmatch(entry.name)
            if m and m["name"] == name and entry.is_dir(follow_symlinks=False):
                found[m["suffix"]].append(entry.path)
    done = []
    olds = sorted(found[OLD_SUFFIX], key=lambda p: os.stat(p).st_mtime)
    if olds and not os.path.exists(final):   # a commit stopped between its renames
        back = olds.pop()
        os.rename(back, final)
        fsync_dir(parent)
        done.append(f"restored {final} from {back} (a save stopped while publishing it)")
    for old in olds:
        shutil.rmtree(old, ignore_errors=True)
        done.append(f"removed {old} (the previous checkpoint of a save that published)")
    for stage in found[STAGING_SUFFIX]:
        age = _age(stage)
        if age > STALE_TMP_SECONDS:
            shutil.rmtree(stage, ignore_errors=True)
            done.append(f"removed {stage} (an unfinished save, {age / 3600:.1f} h old)")
        else:
            done.append(f"left {stage}: a save that stopped {age:.0f} s ago or is still running; removed once it "
                        f"is {STALE_TMP_SECONDS / 3600:g} h old")
    return done


def recover_directories(parent: str) -> list:
    """`recover_directory` for every checkpoint under `parent` that interrupted commits touched.

    Args:
      parent: the directory holding the checkpoint directories (a Trainer's output_dir).

    Returns:
      The descriptions of what was restored, removed or left.
    """
    names = set()
    with contextlib.suppress(OSError):
        names = {m["name"] for m in map(_AUX.fullmatch, os.listdir(parent)) if m}
    return [what for name in sorted(names) for what in recover_directory(os.path.join(parent, name))]


def commit_directory(stage: str, final: str, token: str) -> None:
    """Publish the finished staging directory `stage` as `final`, replacing what was there.

    Every file under `stage` is fsynced first; then the previous `final` (if any) is
    renamed aside, `stage` renamed to `final`, and the previous one removed.

    Args:
      stage: the directory the save wrote (its `staging_path` or a directory inside it).
      final: the checkpoint directory to publish.
      token: the save's token (names the aside directory).

    Raises:
      OSError: another job published `final` between the two renames (its checkpoint
        stands, whole; the previous one is removed by the next `recover_directory`).
    """
    final = os.path.normpath(os.fspath(final))
    fsync_tree(stage)
    old = _aux(final, token, OLD_SUFFIX)
    if os.path.exists(final):
        os.rename(final, old)
    os.rename(stage, final)
    fsync_dir(os.path.dirname(final) or ".")
    if os.path.exists(old):
        shutil.rmtree(old)
