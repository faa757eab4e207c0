"""What the deployment checks share: where things are, a real Helm, rendering and
validating (see each test module's docstring for what it checks)."""

import os
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "dpumesh-node"
DPF = ROOT / "deploy" / "dpf"
K8S = ROOT / "deploy" / "k8s"
# The Kubernetes versions the manifests are validated for: the oldest DPF v25.10
# supports (1.32-1.34) and the newest release kubernetes-validate knows (1.37), so a
# field removed since, or one too new for DPF's clusters, is caught.
KUBERNETES = ("1.32.0", "1.37.0")


def crds_dir():
    given = os.environ.get("DPUMESH_DPF_CRDS")
    candidates = [Path(given)] if given else []
    candidates += [p / "shared" / "reference" / "dpf-crds" for p in ROOT.parents]
    for c in candidates:
        if (c / "svc.dpu.nvidia.com_dpudeployments.yaml").is_file():
            return c
    pytest.fail(
        "the DPF CRDs are not at ../shared/reference/dpf-crds (set DPUMESH_DPF_CRDS)"
    )


@pytest.fixture(scope="session")
def helm():
    out = subprocess.run(
        [str(ROOT / "scripts" / "install-deploy-tools.sh")],
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip().splitlines()[-1]


def run(args, **kw):
    return subprocess.run(args, capture_output=True, text=True, **kw)


def render(helm, *args, values=None, tmp=None):
    cmd = [helm, "template", "dpumesh-node", str(CHART), "--namespace", "dpumesh"]
    if values is not None:
        path = tmp / "values.yaml"
        path.write_text(yaml.safe_dump(values))
        cmd += ["-f", str(path)]
    return run(cmd + list(args))


def docs(text):
    return [d for d in yaml.safe_load_all(text) if d]


def kubernetes_validate(tmp, text):
    """Validates `text` for each of KUBERNETES: the first refusal, or the last pass."""
    path = tmp / "rendered.yaml"
    path.write_text(text)
    for version in KUBERNETES:
        out = run(
            ["kubernetes-validate", "--strict", "--quiet", "-k", version, str(path)]
        )
        if out.returncode != 0:
            out.stderr = f"(Kubernetes {version}) {out.stderr}"
            return out
    return out


def the(objects, kind):
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"one {kind}: {[o['kind'] for o in objects]}"
    return found[0]


def kustomize(path):
    out = run(["kubectl", "kustomize", str(path)])
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    for b in ("dpumesh", "hotel"):
        if not (ROOT / "target" / "debug" / b).is_file():
            pytest.fail(f"target/debug/{b} is not built: the test command's cargo test builds it")
    subprocess.run([str(ROOT / "scripts" / "install-deploy-tools.sh")], check=True, capture_output=True)
    out = tmp_path_factory.mktemp("images")
    cmd = [str(ROOT / "scripts" / "build-images.sh"), "--arch", "amd64", "--profile", "dev", "--no-build", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, shlex.join(cmd) + "\n" + done.stdout + done.stderr
    return out
