"""The images run as their pods run them: each image's filesystem unpacked from its
OCI archive as a runtime lays it out (every layer, owners and modes as the layers
say), its entry point started in it (chroot, /proc mounted) as uid and gid 65532
with the pod's fsGroup 65532 as a supplementary group, and the Secrets and the
ConfigMap laid out as the kubelet lays them out: a timestamped folder holding the
files (root-owned, group 65532 by fsGroup, mode 0440 for the Secrets), a `..data`
link to it, and one link per key. No volume covers the folders the image writes.

- The node starts, reads its key, compiles its filters into the image's own cache
  folder and makes its control socket in the image's /run/dpumesh; it is Ready
  before any pod registers (it names the pods it waits for).
- A hotel pod (the hotel image, the node's /run/dpumesh bind-mounted as the host
  folder) registers with it across the two roots, memory passed as descriptors.
- The ingress reads its key and reaches the node over mutual TLS.

Linux as root only (chroot, mounts); the fixture builds the images (test_images)."""

import base64
import io
import json
import os
import shutil
import socket
import subprocess
import tarfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from conftest import K8S, ROOT

VERSION = "0.1.0"
USER = 65532
STAMP = "..2026_11_29_07_00_00.000000001"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chroot and mounts need root")


def blob(archive, digest):
    return archive.extractfile("blobs/sha256/" + digest.split(":", 1)[1]).read()


def unpack(archive_path, root):
    """The image's filesystem and its config, as a runtime unpacks it."""
    with tarfile.open(archive_path) as archive:
        index = json.loads(archive.extractfile("index.json").read())
        (entry,) = index["manifests"]
        manifest = json.loads(blob(archive, entry["digest"]))
        config = json.loads(blob(archive, manifest["config"]["digest"]))
        for layer in manifest["layers"]:
            with tarfile.open(fileobj=io.BytesIO(blob(archive, layer["digest"]))) as t:
                t.extractall(root, numeric_owner=True, filter="fully_trusted")
    return config["config"]


def kubelet_volume(folder, files, mode):
    """A Secret or ConfigMap volume as the kubelet writes it with fsGroup 65532."""
    data = folder / STAMP
    data.mkdir(parents=True)
    for name, content in files.items():
        path = data / name
        path.write_bytes(content)
        os.chown(path, 0, USER)
        os.chmod(path, mode)
    os.chown(data, 0, USER)
    os.chmod(data, 0o750)
    os.chown(folder, 0, USER)
    os.chmod(folder, 0o750)
    (folder / "..data").symlink_to(STAMP)
    for name in files:
        (folder / name).symlink_to(f"..data/{name}")


def secret(secrets, name):
    doc = yaml.safe_load((secrets / f"{name}.yaml").read_text())
    return {k: base64.b64decode(v) for k, v in doc["data"].items()}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port, path):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return None, str(e)


class Container:
    """An image's entry point running in its unpacked root as the pod's user."""

    def __init__(self, root, entrypoint, args, env, log):
        (root / "proc").mkdir(exist_ok=True)
        subprocess.run(["mount", "-t", "proc", "proc", str(root / "proc")], check=True)
        self.mounts = [root / "proc"]
        self.root, self.log = root, log
        self.proc = subprocess.Popen(
            [shutil.which("chroot"), f"--userspec={USER}:{USER}", f"--groups={USER}", str(root)]
            + entrypoint
            + args,
            env={"PATH": "/usr/bin", **env},
            stdout=subprocess.DEVNULL,
            stderr=open(log, "wb"),
        )

    def output(self):
        return self.log.read_text(errors="replace")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for m in reversed(self.mounts):
            subprocess.run(["umount", "-l", str(m)], check=False)
        return self.proc.returncode


def wait(what, timeout, check, container):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if container.proc.poll() is not None:
            pytest.fail(f"exited ({container.proc.returncode}) before {what}:\n{container.output()}")
        result = check()
        if result:
            return result
        time.sleep(0.2)
    pytest.fail(f"no {what} within {timeout} s:\n{container.output()}")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    """The deploy mesh with local addresses, its certificates as Secrets, and the
    ConfigMap's files."""
    tmp = tmp_path_factory.mktemp("mesh")
    ports = {k: free_port() for k in ("fabric0", "admin0", "fabric1", "admin1", "listen", "iadmin")}
    mesh = yaml.safe_load((K8S / "mesh" / "mesh.yaml").read_text())
    mesh["identity"]["certs"] = str(tmp / "ca")
    mesh["ingress"] = {"listen": f"127.0.0.1:{ports['listen']}", "admin": f"127.0.0.1:{ports['iadmin']}"}
    mesh["nodes"] = {
        "dpu-worker-0": {"fabric": f"127.0.0.1:{ports['fabric0']}", "admin": f"127.0.0.1:{ports['admin0']}"},
        "dpu-worker-1": {"fabric": f"127.0.0.1:{ports['fabric1']}", "admin": f"127.0.0.1:{ports['admin1']}"},
    }
    files = {
        "mesh.yaml": yaml.safe_dump(mesh).encode(),
        "policy.yaml": (K8S / "mesh" / "policy.yaml").read_bytes(),
    }
    for extra in (K8S / "mesh").iterdir():
        if extra.name not in ("mesh.yaml", "policy.yaml", "kustomization.yaml"):
            files[extra.name] = extra.read_bytes()
    (tmp / "mesh.yaml").write_bytes(files["mesh.yaml"])
    done = subprocess.run(
        [str(ROOT / "target" / "debug" / "dpumesh"), "certs", "--config", str(tmp / "mesh.yaml"),
         "--secrets", str(tmp / "secrets")],
        capture_output=True, text=True,
    )
    assert done.returncode == 0, done.stderr
    return {"ports": ports, "config": files, "secrets": tmp / "secrets"}


@pytest.fixture(scope="module")
def roots(built, tmp_path_factory):
    out = {}
    for name in ("node", "ingress", "hotel"):
        root = tmp_path_factory.mktemp(name) / "root"
        root.mkdir()
        out[name] = (root, unpack(built / f"dpumesh-{name}-{VERSION}-amd64.tar", root))
    yield out
    for root, _ in out.values():
        subprocess.run(["umount", "-l", str(root / "proc")], check=False, capture_output=True)


def test_the_images_own_only_the_folders_they_write(roots):
    for name in ("node", "ingress"):
        root, config = roots[name]
        assert config["User"] == f"{USER}:{USER}"
        for folder in ("var/cache/dpumesh", "run/dpumesh"):
            st = (root / folder).stat()
            assert (st.st_uid, st.st_gid) == (USER, USER), f"{name}: {folder}"
        for path in ("usr/bin/dpumesh", "etc/passwd", "usr/share/dpumesh/filters/jwt.wasm"):
            assert (root / path).stat().st_uid == 0, f"{name}: {path} is the user's"


def test_each_image_runs_as_its_user_and_reads_its_keys(roots, mesh, tmp_path):
    ports = mesh["ports"]
    node_root, node_config = roots["node"]
    kubelet_volume(node_root / "etc/dpumesh/config", mesh["config"], 0o644)
    certs = node_root / "etc/dpumesh/certs"
    for n in ("dpu-worker-0", "dpu-worker-1"):
        kubelet_volume(certs / n, secret(mesh["secrets"], f"dpumesh-node-{n}"), 0o440)
    # What the chart sets (software data path), nothing covering the image's folders.
    node = Container(
        node_root,
        node_config["Entrypoint"],
        ["--mesh", "/etc/dpumesh/config/mesh.yaml", "--name", "dpu-worker-0"],
        {
            "DPUMESH_NODE_CONTROL": "unix:/run/dpumesh/dpu-worker-0.sock",
            "DPUMESH_DATA_PATH": "software",
            "DPUMESH_CERTS": "/etc/dpumesh/certs/dpu-worker-0",
            "DPUMESH_LOG_FORMAT": "json",
        },
        tmp_path / "node.log",
    )
    containers = [node]
    try:
        # Ready before any pod registers; it names the pods it waits for.
        status, body = wait(
            "a ready node", 600, lambda: (r := get(ports["admin0"], "/readyz"))[0] == 200 and r, node
        )
        assert body.startswith("ready\nwaiting: ") and '0 of 2 pods of "user" registered' in body, body
        assert (node_root / "run/dpumesh/dpu-worker-0.sock").is_socket()
        cached = [p for p in (node_root / "var/cache/dpumesh").rglob("*") if p.is_file()]
        assert cached, "the filters were compiled into the image's cache folder"
        assert all(p.stat().st_uid == USER for p in cached)

        # A hotel pod: the node's folder is its hostPath /run/dpumesh.
        hotel_root, hotel_config = roots["hotel"]
        (hotel_root / "run/dpumesh").mkdir(parents=True, exist_ok=True)
        token = secret(mesh["secrets"], "dpumesh-token-user")["token"].decode().strip()
        subprocess.run(
            ["mount", "--bind", str(node_root / "run/dpumesh"), str(hotel_root / "run/dpumesh")],
            check=True,
        )
        pod = Container(
            hotel_root,
            hotel_config["Entrypoint"],
            ["user"],
            {
                "DPUMESH_CONTROL": "unix:/run/dpumesh/dpu-worker-0.sock",
                "DPUMESH_SERVICE": "user",
                "DPUMESH_POD": "hotel-user-0",
                "DPUMESH_TOKEN": token,
                "DPUMESH_REGISTER_PATIENCE": "forever",
            },
            tmp_path / "hotel.log",
        )
        pod.mounts.insert(0, hotel_root / "run/dpumesh")
        containers.append(pod)
        wait(
            "the pod's registration",
            60,
            lambda: '1 of 2 pods of "user" registered' in get(ports["admin0"], "/readyz")[1],
            pod,
        )

        # The ingress: its key from its Secret, mutual TLS to the node.
        ingress_root, ingress_config = roots["ingress"]
        kubelet_volume(ingress_root / "etc/dpumesh/config", mesh["config"], 0o644)
        kubelet_volume(
            ingress_root / "etc/dpumesh/certs", secret(mesh["secrets"], "dpumesh-ingress"), 0o440
        )
        ingress = Container(
            ingress_root,
            ingress_config["Entrypoint"],
            ["--mesh", "/etc/dpumesh/config/mesh.yaml"],
            {"DPUMESH_CERTS": "/etc/dpumesh/certs", "DPUMESH_LOG_FORMAT": "json"},
            tmp_path / "ingress.log",
        )
        containers.append(ingress)
        # No token: the node's JWT filter answers 401, which only a node the ingress
        # reached (and proved itself to) can say.
        status, body = wait(
            "an answer through the ingress",
            60,
            lambda: (r := get(ports["listen"], "/hotels"))[0] in (401, 403) and r,
            ingress,
        )
        assert status == 401, body
    finally:
        codes = {c.log.stem: c.stop() for c in reversed(containers)}
    # SIGTERM (the kubelet's) ends the node and the ingress cleanly; the hotel sample
    # sets no handler, so the signal ends it.
    assert codes == {"ingress": 0, "hotel": -15, "node": 0}, (
        codes,
        [c.output()[-2000:] for c in containers],
    )
