"""Registered background jobs stop while something is measured, and continue after, even when it raises."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from headstart.runtime import background

JOB = """
import sys, time
from headstart.runtime import background
background.register("test job")
print("ready", flush=True)
while True:
    time.sleep(0.01)
"""


def state(pid: int) -> str:
    """The process's state letter from /proc: R/S running or sleeping, T stopped."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.fixture
def job(tmp_path, monkeypatch):
    monkeypatch.setenv("HEADSTART_CACHE", str(tmp_path))
    monkeypatch.delenv("HEADSTART_BACKGROUND", raising=False)
    proc = subprocess.Popen([sys.executable, "-c", JOB], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    yield proc
    proc.kill()
    proc.wait()


def wait_for(pid: int, letters: str) -> str:
    for _ in range(200):
        s = state(pid)
        if s in letters:
            return s
        time.sleep(0.01)
    return state(pid)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_a_registered_job_stops_while_measuring_and_continues_after(job):
    assert [j["pid"] for j in background.registered()] == [job.pid]
    assert wait_for(job.pid, "RS") in "RS"
    with background.paused(quiet=True) as stopped:
        assert [j["pid"] for j in stopped] == [job.pid]
        assert wait_for(job.pid, "T") == "T"
    assert wait_for(job.pid, "RS") in "RS"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_a_measurement_inside_another_leaves_the_job_to_the_outer_one(job):
    """A bench pauses the training, then starts a server that measures its costs inside a pause of its own: the
    inner pause must not continue the training while the bench still measures."""
    with background.paused(quiet=True):
        assert wait_for(job.pid, "T") == "T"
        with background.paused(quiet=True) as inner:
            assert inner == []
        time.sleep(0.05)
        assert state(job.pid) == "T"
    assert wait_for(job.pid, "RS") in "RS"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_a_failing_measurement_still_continues_the_job(job):
    with pytest.raises(RuntimeError), background.paused(quiet=True):
        assert wait_for(job.pid, "T") == "T"
        raise RuntimeError("the benchmark failed")
    assert wait_for(job.pid, "RS") in "RS"


def test_a_dead_job_is_forgotten(tmp_path, monkeypatch):
    monkeypatch.setenv("HEADSTART_CACHE", str(tmp_path))
    monkeypatch.delenv("HEADSTART_BACKGROUND", raising=False)
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(proc.stdout)
    background.folder().mkdir(parents=True)
    (background.folder() / f"{dead}.json").write_text(f'{{"pid": {dead}, "what": "gone"}}')
    assert background.registered() == []
    assert not list(background.folder().glob("*.json"))


def test_a_job_unregisters_when_it_exits(tmp_path, monkeypatch):
    monkeypatch.setenv("HEADSTART_CACHE", str(tmp_path))
    monkeypatch.delenv("HEADSTART_BACKGROUND", raising=False)
    code = "from headstart.runtime import background; background.register('short')"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert not list(background.folder().glob("*.json"))
