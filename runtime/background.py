"""Background jobs that step aside while something is measured.

On a 2-core machine a benchmark beside a training run measures nothing. Long jobs (`train/heads.py`,
`headstart distill`) `register()` themselves: a pid file under `~/.cache/headstart/background/`, removed when
they exit. `paused()` stops every registered job that is still alive (SIGSTOP) for the length of a
measurement and continues it after (SIGCONT), even when the measurement raises; `headstart bench` and the
`make bench-*` scripts measure inside it. A job already stopped (another measurement paused it, in this
process or another: a bench that starts a server which measures its own costs) is left to whoever stopped it.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from headstart.runtime.paths import cache_dir


def folder() -> Path:
    """Where jobs register: $HEADSTART_BACKGROUND (the test suite's own), else the cache's `background/`."""
    return Path(os.environ.get("HEADSTART_BACKGROUND") or cache_dir() / "background")


def register(what: str) -> Path:
    """Mark this process as a background job (`what` names it) until it exits."""
    path = folder() / f"{os.getpid()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pid": os.getpid(), "what": what, "since": time.time()}))
    atexit.register(path.unlink, missing_ok=True)
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, and not ours to stop
        return False
    return True


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (its /proc state letter is T); False where there is no /proc."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "Tt"
    except (OSError, IndexError):
        return False


def registered() -> list[dict]:
    """The registered jobs still alive (pid files of dead ones are removed)."""
    jobs = []
    for path in sorted(folder().glob("*.json")) if folder().is_dir() else []:
        try:
            job = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if job.get("pid") == os.getpid():
            continue
        if _alive(int(job["pid"])):
            jobs.append(job)
        else:
            path.unlink(missing_ok=True)
    return jobs


@contextlib.contextmanager
def paused(quiet: bool = False) -> Iterator[list[dict]]:
    """Stop the registered background jobs while the block runs; continue them after it (whatever happens). Jobs
    stopped already stay as they are: the measurement that stopped them continues them."""
    jobs = [job for job in registered() if not _stopped(int(job["pid"]))]
    stopped = []
    try:
        for job in jobs:
            try:
                os.kill(job["pid"], signal.SIGSTOP)
                stopped.append(job)
            except ProcessLookupError:
                continue
        if stopped and not quiet:
            names = ", ".join(f"{j['what']} (pid {j['pid']})" for j in stopped)
            print(f"headstart: paused while measuring: {names}", file=sys.stderr)
        yield stopped
    finally:
        for job in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(job["pid"], signal.SIGCONT)
