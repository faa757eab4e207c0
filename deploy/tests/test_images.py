"""The container images: every Containerfile parses to what the build script stages,
and the script builds the amd64 images from the test build's binaries (CI's run; the
release arm64 + amd64 build is the same script without --profile dev, run by hand:
docs/deploy-bluefield.md), each an OCI archive with the platform, entrypoint,
non-root user and files a cluster needs. The script itself starts every image's
binary from the staged root through the image's own loader before it builds.
"""

import io
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "deploy" / "images"
VERSION = "0.1.0"
KNOWN = {"FROM", "ARG", "LABEL", "COPY", "ENV", "USER", "EXPOSE", "ENTRYPOINT", "CMD"}


def instructions(path):
    """(instruction, arguments) per line, continuations joined, comments dropped."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.strip().partition(" ")
        out.append((word, rest.strip()))
    assert not pending, f"{path.name}: a continuation runs off the end"
    return out


@pytest.mark.parametrize("name", ["node", "ingress", "service-base", "hotel"])
def test_each_containerfile_parses_to_a_minimal_non_root_image(name):
    steps = instructions(IMAGES / f"{name}.Containerfile")
    words = [w for w, _ in steps]
    assert set(words) <= KNOWN, f"{name}: {set(words) - KNOWN} (no RUN: arm64 builds run nothing)"
    froms = [a for w, a in steps if w == "FROM"]
    assert froms == (["${BASE}"] if name == "hotel" else ["scratch"]), froms
    copies = [a for w, a in steps if w == "COPY"]
    # The script stages rootfs/ (root's) and, for the roles that write, rootfs-rw/
    # (the user's own).
    want = ["rootfs/ /"]
    if name in ("node", "ingress"):
        want.append("--chown=65532:65532 rootfs-rw/ /")
    assert copies == want, copies
    users = [a for w, a in steps if w == "USER"]
    assert users and users[-1] == "65532:65532", users
    entry = [a for w, a in steps if w == "ENTRYPOINT"]
    if name == "service-base":
        assert not entry
    else:
        argv = json.loads(entry[-1])
        assert argv[0].startswith("/usr/bin/"), argv
        assert {"node": ["node"], "ingress": ["ingress"], "hotel": []}[name] == argv[1:]


def blob(archive, digest):
    return archive.extractfile("blobs/sha256/" + digest.split(":", 1)[1]).read()


def image(path):
    """Config and the file names of every layer of a single-image OCI archive."""
    with tarfile.open(path) as archive:
        index = json.loads(archive.extractfile("index.json").read())
        (entry,) = index["manifests"]
        manifest = json.loads(blob(archive, entry["digest"]))
        config = json.loads(blob(archive, manifest["config"]["digest"]))
        files = set()
        for layer in manifest["layers"]:
            with tarfile.open(fileobj=io.BytesIO(blob(archive, layer["digest"]))) as t:
                files |= {n.lstrip("./") for n in t.getnames()}
        return entry, config, files


def test_the_script_builds_each_image_as_an_oci_archive(built):
    names = sorted(p.name for p in built.glob("*.tar"))
    assert names == sorted(
        f"dpumesh-{n}-{VERSION}-amd64.tar" for n in ("node", "ingress", "service-base", "hotel")
    )
    for name in ("node", "ingress"):
        entry, config, files = image(built / f"dpumesh-{name}-{VERSION}-amd64.tar")
        assert entry["annotations"]["org.opencontainers.image.ref.name"] == f"dpumesh/{name}:{VERSION}"
        assert (config["architecture"], config["os"]) == ("amd64", "linux")
        assert config["config"]["Entrypoint"] == ["/usr/bin/dpumesh", name]
        assert config["config"]["User"] == "65532:65532"
        assert config["config"]["Labels"]["org.opencontainers.image.version"] == VERSION
        for f in ("usr/bin/dpumesh", "lib64/ld-linux-x86-64.so.2", "lib/x86_64-linux-gnu/libc.so.6", "etc/passwd", "tmp", "var/cache/dpumesh"):
            assert f in files, f"{name}: {f} missing"
        # What the chart's and the deploy examples' policies name.
        for f in ("trace", "jwt", "rbac", "ratelimit", "circuit-breaker"):
            assert f"usr/share/dpumesh/filters/{f}.wasm" in files, f"{name}: {f}"
    _, config, files = image(built / f"dpumesh-hotel-{VERSION}-amd64.tar")
    assert config["config"]["Entrypoint"] == ["/usr/bin/hotel"]
    # The service base's layer is under the hotel binary's.
    assert "usr/bin/hotel" in files and "lib/x86_64-linux-gnu/libc.so.6" in files
    assert "usr/bin/dpumesh" not in files


def test_the_doca_image_is_built_only_where_doca_is_and_says_so(tmp_path):
    # dpumesh/node-doca links DOCA's libraries and carries them: without them the
    # script stops before it builds anything, naming where it looked.
    cmd = [str(ROOT / "scripts" / "build-images.sh"), "--doca", "--arch", "arm64", "--no-build", "--out", str(tmp_path)]
    env = {**os.environ, "DOCA_LIB_DIR": str(tmp_path / "no-doca")}
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"the DOCA SDK's arm64 libraries are not at {tmp_path / 'no-doca'}" in done.stderr
    assert not list(tmp_path.glob("*.tar"))
