"""The DPU proxy's Helm chart (deploy/helm/dpumesh-node), rendered by a real Helm
(scripts/install-deploy-tools.sh) with three value sets: its defaults (the software
data path, beside the pods), and the values DPF passes it for the standalone
DPUService and for the DPUDeployment (dpf_values: computed from our DPF objects as
DPF's controllers compute them). Each passes `helm lint --strict`, renders, and
validates against the Kubernetes schemas (kubernetes-validate, strict, pinned
version); the pods carry what DPF and the data path need and nothing more. The
values schema refuses what would not run."""

import pytest
import yaml

import dpf_values
from conftest import CHART, DPF, docs, kubernetes_validate, kustomize, render, run, the


def dpf_objects(path):
    return docs(kustomize(path))


def value_sets():
    standalone = dpf_objects(DPF / "standalone")
    service = next(o for o in standalone if o["kind"] == "DPUService")
    interfaces = {o["metadata"]["name"]: o for o in standalone if o["kind"] == "DPUServiceInterface"}
    path = dpf_objects(DPF)
    pick = lambda kind: next(o for o in path if o["kind"] == kind)  # noqa: E731
    return {
        "defaults": None,
        "DPUService": dpf_values.for_dpuservice(service, interfaces),
        "DPUDeployment": dpf_values.for_dpudeployment(
            pick("DPUDeployment"), pick("DPUServiceTemplate"), pick("DPUServiceConfiguration")
        ),
    }


VALUES = value_sets()


def rendered(helm, tmp_path, name):
    out = render(helm, values=VALUES[name], tmp=tmp_path)
    assert out.returncode == 0, f"{name}: {out.stderr}"
    return out.stdout


def proxy_pod(text):
    return the(docs(text), "DaemonSet")["spec"]["template"]


@pytest.mark.parametrize("name", sorted(VALUES))
def test_the_chart_lints_and_renders_to_valid_objects(helm, tmp_path, name):
    args = [helm, "lint", "--strict", str(CHART)]
    if VALUES[name] is not None:
        path = tmp_path / "lint-values.yaml"
        path.write_text(yaml.safe_dump(VALUES[name]))
        args += ["-f", str(path)]
    lint = run(args)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    text = rendered(helm, tmp_path, name)
    kinds = sorted(o["kind"] for o in docs(text))
    want = ["DaemonSet", "ServiceAccount"]
    if VALUES[name] is None or not VALUES[name].get("mesh", {}).get("existingConfigMap"):
        want = ["ConfigMap"] + want
    assert kinds == want
    valid = kubernetes_validate(tmp_path, text)
    assert valid.returncode == 0, valid.stdout + valid.stderr


def test_the_dpf_values_are_what_dpf_injects():
    # The shapes DPF's controllers produce (checked here so that the chart tests
    # below really render with them).
    for name in ("DPUService", "DPUDeployment"):
        sds = VALUES[name]["serviceDaemonSet"]
        assert sds["annotations"]["k8s.v1.cni.cncf.io/networks"] == (
            '[{"name":"mybrsfc","interface":"fabric"}]'
        )
        assert sds["resources"] == {"nvidia.com/bf_sf": "1"}
        assert sds["labels"]["svc.dpu.nvidia.com/service"]
        assert sds["nodeSelector"]["nodeSelectorTerms"]
        assert sds["updateStrategy"]["type"] == "RollingUpdate"
    assert VALUES["DPUDeployment"]["serviceDaemonSet"]["labels"][
        "svc.dpu.nvidia.com/service"
    ] == "dpudeployment_dpumesh_dpumesh-node"
    # The configuration's values win over the template's.
    assert "mesh" in VALUES["DPUDeployment"] and "image" in VALUES["DPUDeployment"]


@pytest.mark.parametrize("name", ["DPUService", "DPUDeployment"])
def test_on_a_dpu_the_pod_takes_what_dpf_gives_it(helm, tmp_path, name):
    text = rendered(helm, tmp_path, name)
    ds = the(docs(text), "DaemonSet")
    template = ds["spec"]["template"]
    pod = template["spec"]
    (proxy,) = pod["containers"]
    sds = VALUES[name]["serviceDaemonSet"]
    # DPF's labels on the pod (its admission policy matches svc.dpu.nvidia.com/
    # service); the selector keeps the chart's own, which never change.
    for k, v in sds["labels"].items():
        assert template["metadata"]["labels"][k] == v, k
    assert not any("dpu.nvidia.com" in k for k in ds["spec"]["selector"]["matchLabels"])
    # The chained SF: Multus attaches it, the device plugin gives it.
    notes = template["metadata"]["annotations"]
    assert notes["k8s.v1.cni.cncf.io/networks"] == sds["annotations"]["k8s.v1.cni.cncf.io/networks"]
    for side in ("requests", "limits"):
        assert proxy["resources"][side]["nvidia.com/bf_sf"] == "1", side
        # The DPU's RDMA device, which DOCA DMA and the Comch server open.
        assert proxy["resources"][side]["rdma/rdma_shared_device_a"] == "1", side
    assert proxy["resources"]["requests"] == proxy["resources"]["limits"]
    # DPF's DPU selection, as required node affinity.
    required = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert required == sds["nodeSelector"]
    assert ds["spec"]["updateStrategy"] == sds["updateStrategy"]
    # Off the host network (else Multus attaches nothing), nothing of the host.
    assert not pod.get("hostNetwork")
    assert not [v for v in pod["volumes"] if "hostPath" in v]
    env = {e["name"]: e.get("value") for e in proxy["env"]}
    assert env["DPUMESH_DATA_PATH"] == "doca"
    # Host agents register the host's pods over Comch; no control port is open.
    assert env["DPUMESH_COMCH"] == "03:00.0,b1:00.0,dpumesh"
    assert "DPUMESH_NODE_CONTROL" not in env
    assert "control" not in {p["name"] for p in proxy["ports"]}
    # The proxy finds its own certificate folder by its DPU node's name.
    assert env["DPUMESH_CERTS"] == "/etc/dpumesh/certs/$(NODE_NAME)"


def test_by_default_the_proxy_runs_beside_its_pods(helm):
    objects = docs(render(helm).stdout)
    template = the(objects, "DaemonSet")["spec"]["template"]
    pod = template["spec"]
    (proxy,) = pod["containers"]
    assert pod["hostNetwork"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    # Its name in the mesh file comes from the Downward API.
    assert proxy["args"][-2:] == ["--name", "$(NODE_NAME)"]
    env = {e["name"]: e for e in proxy["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["DPUMESH_LOG_FORMAT"]["value"] == "json"
    assert env["DPUMESH_DATA_PATH"]["value"] == "software"
    # Pods register on a Unix socket (descriptors pass only there), in a host
    # folder that must exist; nothing else of the host is mounted.
    assert env["DPUMESH_NODE_CONTROL"]["value"] == "unix:/run/dpumesh/$(NODE_NAME).sock"
    host = {v["name"]: v["hostPath"] for v in pod["volumes"] if "hostPath" in v}
    assert host == {"run": {"path": "/run/dpumesh", "type": "Directory"}}
    assert "control" not in {p["name"] for p in proxy["ports"]}
    # Guaranteed QoS: requests equal limits, cpu and memory only.
    assert proxy["resources"]["requests"] == proxy["resources"]["limits"]
    assert set(proxy["resources"]["limits"]) == {"cpu", "memory"}
    assert proxy["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    admin = next(p for p in proxy["ports"] if p["name"] == "admin")
    assert admin["containerPort"] == 9101
    assert proxy["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "admin"}
    assert proxy["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
    assert proxy["startupProbe"]["httpGet"]["path"] == "/healthz"
    notes = template["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true"
    assert notes["prometheus.io/port"] == "9101"
    # The ConfigMap is a whole-folder volume: a subPath mount never sees an update,
    # and no checksum annotation rolls the pods on a change (they reload it).
    config = next(m for m in proxy["volumeMounts"] if m["name"] == "config")
    assert config["mountPath"] == "/etc/dpumesh/config" and "subPath" not in config
    assert not any(k.startswith("checksum/") for k in notes)
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["config"]["configMap"]["name"] == "dpumesh-node-config"
    assert volumes["certs-dpu-worker-0"]["secret"]["secretName"] == "dpumesh-node-dpu-worker-0"
    config_map = the(objects, "ConfigMap")
    assert set(config_map["data"]) == {"mesh.yaml", "policy.yaml", "jwks.json"}


def test_an_existing_configmap_replaces_the_charts_own(helm):
    objects = docs(render(helm, "--set", "mesh.existingConfigMap=my-mesh").stdout)
    assert not [o for o in objects if o["kind"] == "ConfigMap"]
    pod = the(objects, "DaemonSet")["spec"]["template"]["spec"]
    config = next(v for v in pod["volumes"] if v["name"] == "config")
    assert config["configMap"]["name"] == "my-mesh"


def test_tracing_sets_opentelemetrys_environment_only_when_asked(helm):
    def env_of(*args):
        objects = docs(render(helm, *args).stdout)
        container = the(objects, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
        return {e["name"]: e.get("value") for e in container["env"]}

    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in env_of()
    env = env_of(
        "--set", "tracing.otlpEndpoint=http://otel-collector.observability:4318",
        "--set-json", "tracing.sampleRatio=0.1",
    )
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability:4318"
    assert env["OTEL_TRACES_SAMPLER_ARG"] == "0.1"


@pytest.mark.parametrize(
    "setting, key",
    [
        ("transport=rdma", "transport"),
        # The shared-memory fabric needs one machine: not offered on a cluster.
        ("transport=shm", "transport"),
        ("ports.admin=0", "admin"),
        ("ports.fabric=70000", "fabric"),
        ("dataPath.backend=rdma", "backend"),
        ("dataPath.hostRunDir=relative", "hostRunDir"),
        ("sf.count=-1", "count"),
        # The software path runs beside its pods: no SF to ask for.
        ("sf.count=1", "count"),
        ("resources.limits.cpu=many", "cpu"),
        ("certs.nodes[0]=Not_A_Name", "nodes"),
        ("log.format=xml", "format"),
        ("image.pullPolicy=Sometimes", "pullPolicy"),
        ("mesh.file=", "file"),
        ("mesh.files.mesh\\.yaml=x", "mesh.yaml"),
        ("imagePullSecret=oops", "imagePullSecret"),
        ("serviceDaemonSet.nodeselector.x=y", "nodeselector"),
        ("serviceDaemonSet.updateStrategy.type=Sometimes", "type"),
        ("rdma.enabled=true", "rdma"),
        ("hugepages.amount=1Gi", "hugepages"),
        # The proxies speak OTLP/HTTP in plaintext to a collector beside them.
        ("tracing.otlpEndpoint=https://collector:4318", "otlpEndpoint"),
        ("tracing.sampleRatio=2", "sampleRatio"),
    ],
)
def test_the_values_schema_refuses_what_would_not_run(helm, setting, key):
    out = render(helm, "--set", setting)
    assert out.returncode != 0, f"{setting} was accepted"
    assert "values don't meet the specifications" in out.stderr, out.stderr
    assert key in out.stderr, out.stderr
