"""The image build of the smoke tests, started in the background as soon as the session
knows it will run them (``tests/conftest.py``), so that it overlaps the other tests: at
the lowest CPU and I/O priority (``nice``/``ionice``), it takes what they leave idle. The
smoke tests run last and wait for it (``wait``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# chroot isolation: no cgroups or namespaces needed, and the host's network (loopback).
ENV = {**os.environ, "BUILDAH_ISOLATION": "chroot"}


class Build:
    """``docker/build-images.sh server operator`` in a process of its own."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvscale-images-"))
        self.timings = self.dir / "timings"
        self.log = self.dir / "build.log"
        low = ["nice", "-n", "19"]
        if shutil.which("ionice"):
            low += ["ionice", "-c", "3"]
        self.start = time.monotonic()
        with self.log.open("wb") as f:
            self.proc = subprocess.Popen(
                [*low, str(ROOT / "docker" / "build-images.sh"), "server", "operator"],
                env={**ENV, "TORCH_VERSION": "2.13.0", "TIMINGS": str(self.timings)},
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait(self, timeout: float) -> str:
        """Waits for the build; its timings (AssertionError with the log's end if it
        failed or ran past ``timeout`` seconds from its start)."""
        left = max(1.0, timeout - (time.monotonic() - self.start))
        try:
            code = self.proc.wait(left)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        tail = self.log.read_text(errors="replace")[-6000:]
        assert code == 0, f"the image build failed (exit {code}):\n{tail}"
        took = time.monotonic() - self.start
        timings = self.timings.read_text() if self.timings.exists() else ""
        return f"images built in the background in {took:.0f} s:\n{timings}"


_build: Build | None = None


def wanted() -> bool:
    """Whether this machine runs the smoke tests (``make test`` installs buildah;
    KVSCALE_SKIP_IMAGES=1 skips them)."""
    return shutil.which("buildah") is not None and os.environ.get("KVSCALE_SKIP_IMAGES") != "1"


def start() -> None:
    """Starts the build once per session."""
    global _build
    if _build is None:
        _build = Build()


def stop() -> None:
    """Ends a build still running (a session that stopped before the smoke tests)."""
    if _build is not None and _build.proc.poll() is None:
        os.killpg(_build.proc.pid, 9)
        _build.proc.wait()


def wait(timeout: float = 1500) -> str:
    """The build's timings, started now if it was not yet."""
    start()
    assert _build is not None
    return _build.wait(timeout)
