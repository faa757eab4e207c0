"""The deployment files, checked as a cluster would check them.

- The Helm chart renders with a real Helm binary (scripts/install-deploy-tools.sh),
  its values schema refuses bad values, and what it renders validates against the
  Kubernetes schemas (kubernetes-validate, strict, pinned version) and carries what
  the issue asks of it (host network, RDMA and hugepages, probes, scrape
  annotations, a watched ConfigMap volume).
- The DPF manifests validate (check-jsonschema) against the DPF CRDs' schemas kept at
  ../shared/reference/dpf-crds, made strict about unknown fields as `kubectl apply
  --validate=strict` is; the values they pass the chart render and validate too.
- The host cluster's kustomization renders with `kubectl kustomize` and validates.
Each check is also shown failing on a broken copy, so a pass means something.
"""

import copy
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "dpumesh-node"
DPF = ROOT / "deploy" / "dpf"
K8S = ROOT / "deploy" / "k8s"
# The Kubernetes version the manifests are validated for (DPF's supported range).
KUBERNETES = "1.32.0"
DPF_GROUP = "svc.dpu.nvidia.com/v1alpha1"


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
    out = run(cmd + list(args))
    return out


def docs(text):
    return [d for d in yaml.safe_load_all(text) if d]


def kubernetes_validate(tmp, text):
    path = tmp / "rendered.yaml"
    path.write_text(text)
    return run(
        ["kubernetes-validate", "--strict", "--quiet", "-k", KUBERNETES, str(path)]
    )


def the(objects, kind):
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"one {kind}: {[o['kind'] for o in objects]}"
    return found[0]


# --- the chart ---------------------------------------------------------------


def test_the_chart_lints_and_renders_to_valid_kubernetes_objects(helm, tmp_path):
    lint = run([helm, "lint", "--strict", str(CHART)])
    assert lint.returncode == 0, lint.stdout + lint.stderr
    out = render(helm)
    assert out.returncode == 0, out.stderr
    kinds = sorted(o["kind"] for o in docs(out.stdout))
    assert kinds == ["ConfigMap", "DaemonSet", "ServiceAccount"]
    valid = kubernetes_validate(tmp_path, out.stdout)
    assert valid.returncode == 0, valid.stdout + valid.stderr


def test_the_daemonset_is_what_a_dpu_proxy_needs(helm):
    objects = docs(render(helm).stdout)
    spec = the(objects, "DaemonSet")["spec"]["template"]
    pod = spec["spec"]
    (proxy,) = pod["containers"]
    assert pod["hostNetwork"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    # Its name in the mesh file comes from the Downward API.
    assert proxy["args"][-2:] == ["--name", "$(NODE_NAME)"]
    env = {e["name"]: e for e in proxy["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["DPUMESH_CERTS"]["value"] == "/etc/dpumesh/certs/$(NODE_NAME)"
    assert env["DPUMESH_LOG_FORMAT"]["value"] == "json"
    # The software data path asks for no RDMA device and no hugepages.
    for side in ("requests", "limits"):
        res = proxy["resources"][side]
        assert set(res) == {"cpu", "memory"}, res
    assert "add" not in proxy["securityContext"]["capabilities"]
    # Probes on the admin port.
    admin = next(p for p in proxy["ports"] if p["name"] == "admin")
    assert admin["containerPort"] == 9101
    assert proxy["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "admin"}
    assert proxy["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
    assert proxy["startupProbe"]["httpGet"]["path"] == "/healthz"
    notes = spec["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true"
    assert notes["prometheus.io/port"] == "9101"
    assert notes["prometheus.io/path"] == "/metrics"
    # The ConfigMap is a whole-folder volume: a subPath mount never sees an update,
    # and no checksum annotation rolls the pods on a change (they reload it).
    config = next(m for m in proxy["volumeMounts"] if m["name"] == "config")
    assert config["mountPath"] == "/etc/dpumesh/config" and "subPath" not in config
    assert not any(k.startswith("checksum/") for k in notes)
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["config"]["configMap"]["name"] == "dpumesh-node-config"
    assert volumes["certs-dpu-worker-0"]["secret"]["secretName"] == (
        "dpumesh-node-dpu-worker-0"
    )
    # The software data path shares memory with the pods on this kernel.
    assert volumes["shm"]["hostPath"]["path"] == "/dev/shm"
    assert volumes["run"]["hostPath"]["path"] == "/run/dpumesh"
    config_map = the(objects, "ConfigMap")
    assert set(config_map["data"]) == {"mesh.yaml", "policy.yaml", "jwks.json"}
    mesh = yaml.safe_load(config_map["data"]["mesh.yaml"])
    assert set(mesh["nodes"]) == {"dpu-worker-0", "dpu-worker-1"}


def test_rdma_and_hugepages_are_requested_and_limited_alike_when_asked(helm):
    objects = docs(
        render(helm, "--set", "rdma.enabled=true,hugepages.amount=1Gi").stdout
    )
    (proxy,) = the(objects, "DaemonSet")["spec"]["template"]["spec"]["containers"]
    for side in ("requests", "limits"):
        res = proxy["resources"][side]
        assert res["rdma/rdma_shared_device_a"] == "1"
        assert res["hugepages-2Mi"] == "1Gi"
    # Registering memory with the RDMA device pins it.
    assert proxy["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    mounts = {m["name"]: m["mountPath"] for m in proxy["volumeMounts"]}
    assert mounts["hugepages"] == "/dev/hugepages"


def test_an_existing_configmap_replaces_the_charts_own(helm):
    objects = docs(render(helm, "--set", "mesh.existingConfigMap=my-mesh").stdout)
    assert not [o for o in objects if o["kind"] == "ConfigMap"]
    pod = the(objects, "DaemonSet")["spec"]["template"]["spec"]
    config = next(v for v in pod["volumes"] if v["name"] == "config")
    assert config["configMap"]["name"] == "my-mesh"


@pytest.mark.parametrize(
    "setting, message",
    [
        ("transport=rdma", "/transport"),
        ("ports.admin=0", "/ports/admin"),
        ("ports.fabric=70000", "/ports/fabric"),
        ("dataPath.backend=doca", "/dataPath/backend"),
        ("hugepages.size=4Mi", "/hugepages/size"),
        ("hugepages.amount=lots", "/hugepages/amount"),
        ("resources.limits.cpu=many", "/resources/limits/cpu"),
        ("certs.nodes[0]=Not_A_Name", "/certs/nodes/0"),
        ("log.format=xml", "/log/format"),
        ("image.pullPolicy=Sometimes", "/image/pullPolicy"),
        ("rdma.count=0", "/rdma/count"),
        ("mesh.file=", "/mesh/file"),
        ("mesh.files.mesh\\.yaml=x", "'mesh.yaml'"),
        ("imagePullSecret=oops", "imagePullSecret"),
    ],
)
def test_the_values_schema_refuses_what_would_not_run(helm, setting, message):
    out = render(helm, "--set", setting)
    assert out.returncode != 0, f"{setting} was accepted"
    assert "values don't meet the specifications" in out.stderr, out.stderr
    assert message in out.stderr, out.stderr


# --- DPF ---------------------------------------------------------------------


def strict(schema):
    """The CRD's structural schema as JSON Schema that refuses unknown fields, as the
    API server does under `kubectl apply --validate=strict` (it prunes them
    otherwise, and a typo'd field silently does nothing)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if (
        out.get("type") == "object"
        and "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def crd_schema(kind):
    for path in crds_dir().glob("*.yaml"):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["kind"] != kind:
            continue
        (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
        schema = strict(version["schema"]["openAPIV3Schema"])
        schema["properties"]["apiVersion"] = {"const": DPF_GROUP}
        schema["properties"]["kind"] = {"const": kind}
        schema["properties"]["metadata"] = {
            "type": "object",
            "required": ["name", "namespace"],
            "properties": {
                "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"}
            },
        }
        schema["required"] = ["apiVersion", "kind", "metadata", "spec"]
        return schema
    pytest.fail(f"no CRD for {kind} in {crds_dir()}")


def check_jsonschema(tmp, kind, manifest):
    schema = tmp / f"{kind}.schema.json"
    schema.write_text(json.dumps(crd_schema(kind)))
    doc = tmp / f"{kind}.yaml"
    doc.write_text(yaml.safe_dump(manifest))
    return run(["check-jsonschema", "--schemafile", str(schema), str(doc)])


MANIFESTS = {
    "DPUServiceTemplate": "dpuservicetemplate.yaml",
    "DPUServiceConfiguration": "dpuserviceconfiguration.yaml",
    "DPUDeployment": "dpudeployment.yaml",
    "DPUService": "dpuservice.yaml",
}


def manifest(kind):
    return yaml.safe_load((DPF / MANIFESTS[kind]).read_text())


@pytest.mark.parametrize("kind", sorted(MANIFESTS))
def test_each_dpf_manifest_validates_against_its_crd(kind, tmp_path):
    out = check_jsonschema(tmp_path, kind, manifest(kind))
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize(
    "kind, breaks, message",
    [
        ("DPUDeployment", lambda m: m["spec"]["serviceChains"].pop("switches"), "switches"),
        ("DPUDeployment", lambda m: m["spec"]["services"]["dpumesh-node"].update(serviceTemplat="x"), "serviceTemplat"),
        ("DPUServiceTemplate", lambda m: m["spec"]["helmChart"]["source"].update(repoURL="ftp://x"), "repoURL"),
        ("DPUServiceConfiguration", lambda m: m["spec"].update(interfaces=[]), "interfaces"),
        ("DPUService", lambda m: m["spec"]["helmChart"]["source"].pop("version"), "version"),
    ],
)
def test_a_broken_dpf_manifest_is_refused(kind, breaks, message, tmp_path):
    m = copy.deepcopy(manifest(kind))
    breaks(m)
    out = check_jsonschema(tmp_path, kind, m)
    assert out.returncode != 0, f"accepted: {m}"
    assert message in out.stdout + out.stderr, out.stdout + out.stderr


def test_the_dpf_objects_refer_to_each_other_and_to_the_chart():
    template, config, deployment = (
        manifest(k) for k in ("DPUServiceTemplate", "DPUServiceConfiguration", "DPUDeployment")
    )
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    name = template["spec"]["deploymentServiceName"]
    assert config["spec"]["deploymentServiceName"] == name
    assert deployment["spec"]["services"][name] == {
        "serviceTemplate": template["metadata"]["name"],
        "serviceConfiguration": config["metadata"]["name"],
    }
    source = template["spec"]["helmChart"]["source"]
    assert source["chart"] == chart["name"] and source["version"] == chart["version"]
    # The CRD's one rule (CEL, which a JSON Schema cannot say): each port of a
    # switch names a service or a service interface, not both; a service's
    # interface is one the configuration declares.
    interfaces = {i["name"] for i in config["spec"]["interfaces"]}
    for switch in deployment["spec"]["serviceChains"]["switches"]:
        for port in switch["ports"]:
            assert ("service" in port) != ("serviceInterface" in port), port
            if "service" in port:
                assert port["service"]["name"] == name
                assert port["service"]["interface"] in interfaces


def merged(base, over):
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merged(out[k], v)
        else:
            out[k] = v
    return out


def test_the_values_dpf_passes_render_the_chart_to_valid_objects(helm, tmp_path):
    # DPF merges the configuration's values over the template's (the CRD's words).
    template = manifest("DPUServiceTemplate")["spec"]["helmChart"]["values"]
    config = manifest("DPUServiceConfiguration")["spec"]["serviceConfiguration"]
    values = merged(template, config["helmChart"]["values"])
    for name, values in [
        ("DPUDeployment", values),
        ("DPUService", manifest("DPUService")["spec"]["helmChart"]["values"]),
    ]:
        out = render(helm, values=values, tmp=tmp_path)
        assert out.returncode == 0, f"{name}: {out.stderr}"
        valid = kubernetes_validate(tmp_path, out.stdout)
        assert valid.returncode == 0, f"{name}: {valid.stdout}{valid.stderr}"
        pod = the(docs(out.stdout), "DaemonSet")["spec"]["template"]["spec"]
        image = pod["containers"][0]["image"]
        assert image == "registry.example.com/dpumesh/node:0.1.0", image
        # On DPUs: the RDMA device and hugepages.
        limits = pod["containers"][0]["resources"]["limits"]
        assert limits["rdma/rdma_shared_device_a"] == "1", f"{name}: {limits}"
        assert limits["hugepages-2Mi"] == "1Gi", f"{name}: {limits}"


# --- the host cluster --------------------------------------------------------


def kustomize(path):
    out = run(["kubectl", "kustomize", str(path)])
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_host_manifests_render_with_kustomize_and_validate(tmp_path):
    text = kustomize(K8S)
    objects = docs(text)
    kinds = sorted({o["kind"] for o in objects})
    assert kinds == [
        "ConfigMap",
        "Deployment",
        "Namespace",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "Service",
        "ServiceAccount",
    ]
    valid = kubernetes_validate(tmp_path, text)
    assert valid.returncode == 0, valid.stdout + valid.stderr
    deployments = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}
    assert set(deployments) == {
        "dpumesh-ingress",
        "hotel-frontend",
        "hotel-user",
        "hotel-reservation",
    }
    assert deployments["hotel-user"]["spec"]["replicas"] == 2
    ingress = deployments["dpumesh-ingress"]["spec"]["template"]["spec"]["containers"][0]
    assert ingress["image"] == "dpumesh/ingress:0.1.0"
    for name in ("frontend", "user", "reservation"):
        pod = deployments[f"hotel-{name}"]["spec"]["template"]["spec"]
        env = {e["name"]: e for e in pod["containers"][0]["env"]}
        assert env["DPUMESH_SERVICE"]["value"] == name
        assert env["DPUMESH_CONTROL"]["value"].startswith("tcp:")
        token = env["DPUMESH_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert token == {"name": f"dpumesh-token-{name}", "key": "token"}
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    deny = next(p for p in policies if p["metadata"]["name"] == "hotel-default-deny")
    assert deny["spec"]["podSelector"] == {} and "ingress" not in deny["spec"]


def secret_readers(pod):
    """The pod's user can read each Secret volume it mounts: the files are root-owned
    (as the kubelet lays them out), so a mode without "others" read needs the pod's
    fsGroup to be the user's group."""
    context = pod.get("securityContext", {})
    for volume in pod.get("volumes", []):
        secret = volume.get("secret")
        if secret is None:
            continue
        mode = secret.get("defaultMode", 0o644)
        if mode & 0o004:
            continue
        assert mode & 0o040, f"{volume['name']}: mode {mode:o} lets no group read"
        assert context.get("fsGroup") == context.get("runAsGroup"), (
            f"{volume['name']} (mode {mode:o}) is root-owned without fsGroup: "
            f"uid {context.get('runAsUser')} cannot read it"
        )


def test_every_pod_can_read_its_keys_and_asks_for_no_hugepages(helm):
    pods = [
        o["spec"]["template"]["spec"]
        for o in docs(kustomize(K8S)) + docs(render(helm).stdout)
        if o["kind"] in ("Deployment", "DaemonSet")
    ]
    assert len(pods) == 5
    for pod in pods:
        secret_readers(pod)
        for c in pod["containers"]:
            for side in ("requests", "limits"):
                asked = c.get("resources", {}).get(side, {})
                assert not any(k.startswith("hugepages-") for k in asked), (c["name"], asked)
        assert not any("emptyDir" in v and "HugePages" in str(v["emptyDir"]) for v in pod.get("volumes", []))
    # A pod without fsGroup is refused by the check.
    bare = {
        "securityContext": {"runAsUser": 65532, "runAsGroup": 65532},
        "volumes": [{"name": "key", "secret": {"secretName": "k", "defaultMode": 0o440}}],
    }
    with pytest.raises(AssertionError, match="cannot read it"):
        secret_readers(bare)


def test_the_ingress_and_the_dpus_read_the_same_mesh():
    values = manifest("DPUServiceConfiguration")["spec"]["serviceConfiguration"]
    mesh = values["helmChart"]["values"]["mesh"]
    for key, file in [("file", "mesh.yaml"), ("policy", "policy.yaml")]:
        assert yaml.safe_load((K8S / "mesh" / file).read_text()) == yaml.safe_load(
            mesh[key]
        ), f"deploy/k8s/mesh/{file} differs from the DPF configuration's mesh.{key}"
    # The mesh file places each hotel service on the DPU its Deployment's hosts carry.
    placed = yaml.safe_load(mesh["file"])["services"]
    for o in docs(kustomize(K8S)):
        if o["kind"] == "Deployment" and o["metadata"]["name"].startswith("hotel-"):
            service = o["metadata"]["name"].removeprefix("hotel-")
            pod = o["spec"]["template"]["spec"]
            dpu = pod["nodeSelector"]["dpumesh.io/dpu"]
            assert placed[service]["nodes"] == [dpu], service
            # ... and registers with that DPU's proxy.
            env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
            host = yaml.safe_load(mesh["file"])["nodes"][dpu]["fabric"].split(":")[0]
            assert env["DPUMESH_CONTROL"] == f"tcp:{host}:7120", service


def test_a_broken_host_manifest_is_refused(tmp_path):
    broken = tmp_path / "k8s"
    shutil.copytree(K8S, broken)
    text = (broken / "ingress.yaml").read_text()
    (broken / "ingress.yaml").write_text(text.replace("replicas: 2", "replicas: two"))
    valid = kubernetes_validate(tmp_path, kustomize(broken))
    assert valid.returncode != 0
    assert "replicas" in valid.stdout + valid.stderr
