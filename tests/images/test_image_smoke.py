"""Smoke tests on the built images (buildah, no Docker daemon): the server image serves, the
operator image reconciles.

The images are built once per test session with ``docker/build-images.sh`` from the
Dockerfiles as they are (a Debian bookworm base made with mmdebstrap passed as PYTHON_IMAGE,
CPU torch selected by build argument). Containers run with ``buildah run`` (chroot isolation,
the host's network), as the user and with the entrypoint the image configures. Skipped where
``buildah`` is not installed (``make test`` installs it).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.k8s_emulator.runner import EmulatorThread
from tests.operator.conftest import ROOT
from tests.operator.harness import Kubectl, wait_for
from tests.ports import free_port

pytestmark = pytest.mark.skipif(
    shutil.which("buildah") is None or os.environ.get("KVSCALE_SKIP_IMAGES") == "1",
    reason="buildah is not installed (make test installs it)",
)

# chroot isolation: no cgroups or namespaces needed, and the host's network (loopback).
ENV = {**os.environ, "BUILDAH_ISOLATION": "chroot"}
# buildah's storage driver: its configured one (overlay here), or STORAGE_DRIVER=vfs where
# overlay mounts are not allowed (passed as --storage-driver to every buildah command).
DRIVER = (
    ["--storage-driver", os.environ["STORAGE_DRIVER"]] if os.environ.get("STORAGE_DRIVER") else []
)
TAG = "0.1.0"
SERVER = f"ghcr.io/kvscale/kvscale-server:{TAG}"
OPERATOR = f"ghcr.io/kvscale/kvscale-operator:{TAG}"
# Files buildah itself bind-mounts or creates in a container's root for `buildah run`.
BUILDAH_FILES = {"/etc/hosts", "/etc/resolv.conf", "/etc/hostname", "/run/.containerenv"}


def buildah(*args: str, timeout: float = 120) -> str:
    proc = subprocess.run(
        ["buildah", *DRIVER, *args], env=ENV, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"buildah {' '.join(args)}: {proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="session")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Both images, built once per session (build times and sizes printed for the log).
    KVSCALE_IMAGES_BUILT=1: use the images already in buildah's storage (e.g. built by an
    earlier step of the same CI run with docker/build-images.sh)."""
    if os.environ.get("KVSCALE_IMAGES_BUILT") == "1":
        return {"server": SERVER, "operator": OPERATOR}
    timings = tmp_path_factory.mktemp("images") / "timings"
    start = time.monotonic()
    proc = subprocess.run(
        [str(ROOT / "docker" / "build-images.sh"), "server", "operator"],
        env={**ENV, "TORCH_VERSION": "2.13.0", "TIMINGS": str(timings)},
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    print(f"\nimages built in {time.monotonic() - start:.0f} s:\n{timings.read_text()}")
    return {"server": SERVER, "operator": OPERATOR}


class Container:
    """A working container of an image; removed on exit."""

    def __init__(self, image: str) -> None:
        self.id = buildah("from", "--pull=never", "--quiet", image).strip()
        info = json.loads(buildah("inspect", "--type", "container", self.id))
        config = info["OCIv1"]["config"]
        self.entrypoint: list[str] = config.get("Entrypoint") or []
        self.cmd: list[str] = config.get("Cmd") or []
        self.user: str = config.get("User", "")
        self.labels: dict[str, str] = config.get("Labels") or {}
        self.root = Path(buildah("mount", self.id).strip())

    def run(
        self,
        args: list[str],
        *,
        log: Path,
        volumes: tuple[str, ...] = (),
        env: tuple[str, ...] = (),
    ) -> subprocess.Popen[bytes]:
        cmd = ["buildah", *DRIVER, "run"]
        for v in volumes:
            cmd += ["-v", v]
        for e in env:
            cmd += ["-e", e]
        with open(log, "ab") as out:
            return subprocess.Popen(
                [*cmd, self.id, "--", *args], env=ENV, stdout=out, stderr=subprocess.STDOUT
            )

    def snapshot(self) -> dict[str, tuple[int, int, int]]:
        """(mode, size, mtime) of everything in the root filesystem outside /tmp."""
        files = {}
        for dirpath, dirnames, filenames in os.walk(self.root):
            rel = "/" + os.path.relpath(dirpath, self.root).lstrip(".")
            if rel in ("/tmp", "/proc", "/sys", "/dev"):
                dirnames[:] = []
                continue
            for name in dirnames + filenames:
                path = os.path.join(dirpath, name)
                st = os.lstat(path)
                key = os.path.join(rel, name)
                files[key] = (st.st_mode, st.st_size, st.st_mtime_ns if name in filenames else 0)
        return files

    def assert_no_build_settings(self) -> None:
        """The build's pip.conf and local indexes were bind-mounted: not even stubs remain."""
        assert not (self.root / "etc" / "pip.conf").exists()
        assert sorted(p.name for p in (self.root / "opt").iterdir()) == ["venv"]

    def close(self) -> None:
        subprocess.run(["buildah", *DRIVER, "umount", self.id], env=ENV, capture_output=True)
        subprocess.run(["buildah", *DRIVER, "rm", self.id], env=ENV, capture_output=True)


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _process(parent: int, argv0: str) -> int | None:
    """The pid of the container's process started as ``argv0`` (under buildah ``parent``)."""
    for pid in _descendants(parent):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        names = [os.path.basename(a.decode()) for a in argv[:2]]
        # buildah-chroot-exec carries the command in its own argv: the process is its child
        if argv0 in names and not names[0].startswith("buildah"):
            return pid
    return None


def _uid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError("no Uid line")


def _http(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as rsp:
            return rsp.status, rsp.read().decode()
    except OSError:
        return 0, ""


def _chart_values() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "charts" / "kvscale" / "values.yaml").read_text())


@pytest.fixture
def server(images: dict[str, str]) -> Iterator[Container]:
    c = Container(images["server"])
    yield c
    c.close()


def test_server_image_serves_drains_and_writes_only_tmp(server: Container, tmp_path: Path) -> None:
    import openai

    assert server.entrypoint == ["kvscale"]
    assert server.cmd[:3] == ["serve", "--model", "demo"]
    assert server.user == "1000:1000"  # the pod spec's runAsUser
    values = _chart_values()
    assert (
        server.labels["org.opencontainers.image.title"]
        == (values["serverImage"]["repository"].rsplit("/", 1)[1])
    )
    server.assert_no_build_settings()
    before = server.snapshot()
    assert len(before) > 1000  # the image's whole root (torch alone has thousands of files)
    port = free_port()  # the image's CMD with its port moved off 8000 (shared host network)
    log = tmp_path / "server.log"
    proc = server.run([*server.entrypoint, *server.cmd, "--port", str(port)], log=log)
    try:
        base = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"server exited {proc.returncode}:\n{log.read_text()}")
            return _http(base + "/ready")[0] == 200

        wait_for(ready, timeout=300, what="the server's /ready")
        pid = _process(proc.pid, "kvscale")
        assert pid is not None, "no kvscale process under buildah run"
        assert _uid(pid) == 1000

        client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=60)
        done = client.completions.create(model="demo", prompt="Hello", max_tokens=8)
        assert done.choices[0].text and done.usage.completion_tokens > 0
        stream = client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=8,
            stream=True,
        )
        chunks = [ch for ch in stream if ch.choices]
        assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")
        status, metrics = _http(base + "/metrics")
        assert status == 200 and "# TYPE" in metrics
        _route_through_the_router(server, base, tmp_path)

        os.kill(pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    after = server.snapshot()
    changed = {
        path
        for path in before.keys() | after.keys()
        if before.get(path) != after.get(path) and path not in BUILDAH_FILES
    }
    assert not changed, f"written outside /tmp: {sorted(changed)[:20]}"


def _route_through_the_router(server: Container, upstream: str, tmp_path: Path) -> None:
    """The image's ``kvscale route`` (spec.router's pods run it) in front of the server."""
    import openai

    port = free_port()
    log = tmp_path / "router.log"
    cmd = ["kvscale", "route", "--upstream", upstream, "--port", str(port), "--policy", "prefix"]
    proc = server.run(cmd, log=log)
    try:

        def up() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"router exited {proc.returncode}:\n{log.read_text()}")
            return _http(f"http://127.0.0.1:{port}/ready")[0] == 200

        wait_for(up, timeout=120, what="the router's /ready")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=60)
        done = client.completions.create(model="demo", prompt=[5, 6, 7], max_tokens=4)
        assert done.usage.completion_tokens == 4
    finally:
        pid = _process(proc.pid, "kvscale")
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_operator_image_reconciles_an_example(images: dict[str, str], tmp_path: Path) -> None:
    c = Container(images["operator"])
    try:
        assert c.entrypoint == ["kopf"] and c.user == "1000:1000"
        c.assert_no_build_settings()
        assert (
            c.labels["org.opencontainers.image.title"]
            == (_chart_values()["image"]["repository"].rsplit("/", 1)[1])
        )
        with EmulatorThread() as emu:
            kubeconfig = emu.write_kubeconfig(tmp_path / "kubeconfig", namespace="ml")
            kubeconfig.chmod(0o644)  # read by the image's user 1000
            kubectl = Kubectl(kubeconfig)
            kubectl("apply", "-f", str(ROOT / "crds"))
            kubectl(
                "apply", "-f", "-", input="apiVersion: v1\nkind: Namespace\nmetadata:\n  name: ml\n"
            )
            port = free_port()
            cmd = [
                a
                if not a.startswith("--liveness=")
                else f"--liveness=http://127.0.0.1:{port}/healthz"
                for a in c.cmd
            ]
            log = tmp_path / "operator.log"
            proc = c.run(
                [*c.entrypoint, *cmd],
                volumes=(f"{kubeconfig}:/etc/kvscale/kubeconfig:ro",),
                env=("KUBECONFIG=/etc/kvscale/kubeconfig",),  # for this run only
                log=log,
            )
            try:

                def alive() -> bool:
                    if proc.poll() is not None:
                        raise AssertionError(f"kopf exited {proc.returncode}:\n{log.read_text()}")
                    return _http(f"http://127.0.0.1:{port}/healthz")[0] == 200

                wait_for(alive, timeout=60, what="the operator's liveness endpoint")
                example = ROOT / "examples" / "llmdeployment.yaml"
                kubectl("apply", "-n", "ml", "-f", str(example))
                name = yaml.safe_load(example.read_text())["metadata"]["name"]

                def made() -> bool:
                    got = kubectl.run("get", "-n", "ml", "deployment,service", name, check=False)
                    return got.returncode == 0 and got.stdout.count(name) >= 2

                wait_for(made, timeout=60, what=f"Deployment and Service {name}")
                dep = kubectl.json("get", "-n", "ml", "deployment", name)
                container = dep["spec"]["template"]["spec"]["containers"][0]
                assert container["image"].startswith(_chart_values()["serverImage"]["repository"])
                pid = _process(proc.pid, "kopf")
                assert pid is not None and _uid(pid) == 1000
                os.kill(pid, signal.SIGTERM)
                proc.wait(timeout=30)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    finally:
        c.close()
