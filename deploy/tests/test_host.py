"""The host cluster's manifests (deploy/k8s), rendered with `kubectl kustomize` and
validated (kubernetes-validate, strict, pinned version); and, for every pod the
project ships (the host's and the chart's under each value set), what no pod may
need: root, a capability, a hostPath it does not use, or a resource the code does
not use; and each pod's user can read its keys. Each check is also shown failing."""

import json
import shutil

import pytest

from conftest import K8S, ROOT, docs, kubernetes_validate, kustomize, render
from test_chart import VALUES


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
        token = env["DPUMESH_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert token == {"name": f"dpumesh-token-{name}", "key": "token"}
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    deny = next(p for p in policies if p["metadata"]["name"] == "hotel-default-deny")
    assert deny["spec"]["podSelector"] == {} and "ingress" not in deny["spec"]


def test_a_broken_host_manifest_is_refused(tmp_path):
    broken = tmp_path / "k8s"
    shutil.copytree(K8S, broken)
    text = (broken / "ingress.yaml").read_text()
    (broken / "ingress.yaml").write_text(text.replace("replicas: 2", "replicas: two"))
    valid = kubernetes_validate(tmp_path, kustomize(broken))
    assert valid.returncode != 0
    assert "replicas" in valid.stdout + valid.stderr


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


# What the code uses: cores and memory, and on a DPU the chained SF.
USED_RESOURCES = {"cpu", "memory", "nvidia.com/bf_sf"}
# What the DOCA data path uses besides: the BlueField's RDMA device (DMA, Comch), on
# the DPU's proxy and the host's agent.
DOCA_RESOURCES = {"rdma/rdma_shared_device_a"}

BLUEFIELD = ROOT / "deploy" / "k8s-bluefield"


def runs_doca(pod):
    """The DOCA data path's pods: the DPU proxy with the doca backend, the host agent."""
    for c in pod["containers"]:
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        if env.get("DPUMESH_DATA_PATH") == "doca" or "DPUMESH_HOST_NODE" in env:
            return True
    return False


def least_privilege(pod):
    context = pod.get("securityContext", {})
    assert context.get("runAsNonRoot") is True and context.get("runAsUser", 0) != 0
    secret_readers(pod)
    for c in pod["containers"] + pod.get("initContainers", []):
        sc = c.get("securityContext", {})
        assert not sc.get("privileged"), c["name"]
        assert sc.get("allowPrivilegeEscalation") is False, c["name"]
        # A non-root user's added capabilities take no effect: none is asked for.
        assert sc.get("capabilities") == {"drop": ["ALL"]}, (c["name"], sc)
        used = USED_RESOURCES | (DOCA_RESOURCES if runs_doca(pod) else set())
        for side in ("requests", "limits"):
            asked = set(c.get("resources", {}).get(side, {}))
            assert asked <= used, (c["name"], side, asked - used)
    for v in pod.get("volumes", []):
        assert "HugePages" not in str(v.get("emptyDir", "")), v
        if "hostPath" in v:
            # The software data path's control socket folder, and nothing else.
            assert v["hostPath"]["path"] == "/run/dpumesh", v
    mounted = {m["name"] for c in pod["containers"] for m in c.get("volumeMounts", [])}
    unused = {v["name"] for v in pod.get("volumes", [])} - mounted
    assert not unused, f"volumes no container mounts: {unused}"


def every_pod(helm, tmp_path):
    pods = [o for o in docs(kustomize(K8S)) if o["kind"] == "Deployment"]
    pods += [o for o in docs(kustomize(BLUEFIELD)) if o["kind"] == "DaemonSet"]
    for name, values in VALUES.items():
        out = render(helm, values=values, tmp=tmp_path)
        assert out.returncode == 0, out.stderr
        pods += [o for o in docs(out.stdout) if o["kind"] == "DaemonSet"]
    return [p["spec"]["template"]["spec"] for p in pods]


def test_no_pod_needs_root_or_what_it_does_not_use(helm, tmp_path):
    pods = every_pod(helm, tmp_path)
    assert len(pods) == 8
    for pod in pods:
        least_privilege(pod)


@pytest.mark.parametrize(
    "breaks, message",
    [
        (lambda p: p["securityContext"].pop("fsGroup"), "cannot read it"),
        (lambda p: p["containers"][0]["securityContext"]["capabilities"].update(add=["IPC_LOCK"]), "IPC_LOCK"),
        (lambda p: p["containers"][0]["resources"]["limits"].update({"hugepages-2Mi": "1Gi"}), "hugepages-2Mi"),
        (lambda p: p["volumes"].append({"name": "shm", "hostPath": {"path": "/dev/shm"}}), "/dev/shm"),
        (lambda p: p["securityContext"].update(runAsNonRoot=False), "runAsNonRoot"),
    ],
)
def test_a_pod_that_asks_for_too_much_is_caught(helm, tmp_path, breaks, message):
    import copy

    pod = copy.deepcopy(every_pod(helm, tmp_path)[-1])
    breaks(pod)
    with pytest.raises(AssertionError, match=message):
        least_privilege(pod)


def test_each_service_registers_with_the_node_the_mesh_file_places_it_on(helm):
    import yaml

    mesh = yaml.safe_load((K8S / "mesh" / "mesh.yaml").read_text())
    placed = mesh["services"]
    # The chart's node serves its control socket in the same host folder.
    (proxy,) = [
        o for o in docs(render(helm).stdout) if o["kind"] == "DaemonSet"
    ][0]["spec"]["template"]["spec"]["containers"]
    served = {e["name"]: e.get("value") for e in proxy["env"]}["DPUMESH_NODE_CONTROL"]
    assert served == "unix:/run/dpumesh/$(NODE_NAME).sock"
    for o in docs(kustomize(K8S)):
        if o["kind"] != "Deployment" or not o["metadata"]["name"].startswith("hotel-"):
            continue
        service = o["metadata"]["name"].removeprefix("hotel-")
        pod = o["spec"]["template"]["spec"]
        node = pod["nodeSelector"]["dpumesh.io/dpu"]
        assert placed[service]["nodes"] == [node], service
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        assert env["DPUMESH_CONTROL"] == served.replace("$(NODE_NAME)", node), service
        assert env["DPUMESH_REGISTER_PATIENCE"] == "forever", service
        mounts = {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        assert "/run/dpumesh" in mounts, service


def test_on_bluefield_hosts_the_pods_register_with_the_host_agent(tmp_path):
    """deploy/k8s-bluefield: the host cluster for the DOCA data path (the proxy on the
    DPU): deploy/k8s with a host agent on each host whose DPU is in the mesh, and
    every service pod registering on the agent's socket in the host folder."""
    import yaml

    text = kustomize(BLUEFIELD)
    valid = kubernetes_validate(tmp_path, text)
    assert valid.returncode == 0, valid.stdout + valid.stderr
    objects = docs(text)
    agents = [o for o in objects if o["kind"] == "DaemonSet"]
    assert [a["metadata"]["name"] for a in agents] == ["dpumesh-host-agent"]
    pod = agents[0]["spec"]["template"]["spec"]
    (agent,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in agent["env"]}
    # The binary where the image has it (the node image's entry point), as `host`.
    entry = [
        line for line in (ROOT / "deploy/images/node.Containerfile").read_text().splitlines()
        if line.startswith("ENTRYPOINT")
    ]
    binary = json.loads(entry[-1].removeprefix("ENTRYPOINT").strip())[0]
    assert agent["command"] == [binary, "host"]
    # Comch to the proxy's server, as the chart's values name it.
    values = yaml.safe_load((ROOT / "deploy/helm/dpumesh-node/values.yaml").read_text())
    pci, server = env["DPUMESH_HOST_NODE"].removeprefix("comch:").split(",")
    assert server == values["dataPath"]["comch"]["server"]
    assert pci.count(":") == 2 and "." in pci, pci
    listen = env["DPUMESH_HOST_LISTEN"]
    assert listen.startswith("/run/dpumesh/")
    # On the hosts the service pods select, which it makes ready for them first.
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"][0]["matchExpressions"] == [
        {"key": "dpumesh.io/dpu", "operator": "Exists"}
    ]
    assert pod["priorityClassName"] == "system-node-critical"
    assert agent["resources"]["requests"]["rdma/rdma_shared_device_a"] == "1"
    assert agent["image"] == "dpumesh/node-doca:0.1.0"
    least_privilege(pod)
    services = [
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].startswith("hotel-")
    ]
    assert len(services) == 3
    for o in services:
        spec = o["spec"]["template"]["spec"]
        service_env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
        assert service_env["DPUMESH_CONTROL"] == f"unix:{listen}", o["metadata"]["name"]
        assert "dpumesh.io/dpu" in spec["nodeSelector"]
        mounts = {m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
        assert "/run/dpumesh" in mounts
    # The rest is deploy/k8s as it is.
    base = {(o["kind"], o["metadata"]["name"]) for o in docs(kustomize(K8S))}
    here = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert here - base == {("DaemonSet", "dpumesh-host-agent"), ("ServiceAccount", "dpumesh-host-agent")}
    assert base <= here


def test_an_agent_that_asks_for_a_device_the_software_path_has_is_caught():
    import copy

    pod = copy.deepcopy(
        next(o for o in docs(kustomize(K8S)) if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    )
    pod["containers"][0]["resources"]["requests"]["rdma/rdma_shared_device_a"] = "1"
    with pytest.raises(AssertionError, match="rdma"):
        least_privilege(pod)
