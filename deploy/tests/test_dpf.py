"""The DPF objects (deploy/dpf), checked as DPF's API server checks them at creation
(dpf_rules: defaults, the CRDs' schemas with unknown fields refused, their CEL
rules) against the current CRDs kept at ../shared/reference/dpf-crds; checked for
what the schemas cannot say (each selector finds its object, addresses agree with
the mesh file); and laid out so that one command applies one path. Each check is
also shown failing on a broken copy."""

import copy
import ipaddress
from pathlib import Path

import pytest
import yaml

import dpf_rules
from conftest import CHART, DPF, K8S, docs, kubernetes_validate, kustomize, run

KINDS = dpf_rules.crds()


def objects(path):
    return docs(kustomize(path))


DEPLOYMENT_PATH = objects(DPF)
STANDALONE_PATH = objects(DPF / "standalone")


def by_kind(objs, kind):
    return [o for o in objs if o["kind"] == kind]


def one(objs, kind, name=None):
    found = [o for o in by_kind(objs, kind) if name is None or o["metadata"]["name"] == name]
    assert len(found) == 1, f"one {kind} {name or ''}: {[o['metadata']['name'] for o in by_kind(objs, kind)]}"
    return found[0]


@pytest.mark.parametrize(
    "obj",
    DEPLOYMENT_PATH + STANDALONE_PATH,
    ids=lambda o: f"{o['kind']}/{o['metadata']['name']}",
)
def test_each_dpf_object_is_valid_against_the_current_crds(obj):
    errors, _ = dpf_rules.validate(obj, KINDS)
    assert errors == [], errors


def test_the_cel_rules_run_and_every_kind_is_shipped():
    ran = sum(dpf_rules.validate(o, KINDS)[1] for o in DEPLOYMENT_PATH + STANDALONE_PATH)
    assert ran >= 30, f"only {ran} CEL rules evaluated"
    shipped = {o["kind"] for o in DEPLOYMENT_PATH + STANDALONE_PATH}
    assert shipped == set(KINDS), set(KINDS) - shipped


def broken(objs, kind, change, name=None):
    obj = copy.deepcopy(one(objs, kind, name))
    change(obj)
    return obj


@pytest.mark.parametrize(
    "objs, kind, change, message",
    [
        (DEPLOYMENT_PATH, "DPUDeployment", lambda o: o["spec"]["dpus"]["nodeEffect"].update(noEffect=True), "nodeEffect"),
        (DEPLOYMENT_PATH, "DPUDeployment", lambda o: o["metadata"].update(name="dpumesh-is-a-long-name"), "bigger than 20"),
        (DEPLOYMENT_PATH, "DPUDeployment", lambda o: o["spec"]["serviceChains"]["switches"][0]["ports"][2].update(serviceInterface={"matchLabels": {"a": "b"}}), "service or serviceInterface"),
        (DEPLOYMENT_PATH, "DPUDeployment", lambda o: o["spec"]["services"]["dpumesh-node"].update(serviceTemplat="x"), "serviceTemplat"),
        (DEPLOYMENT_PATH, "DPUDeployment", lambda o: o["spec"].update(serviceChains=[{"ports": []}]), "serviceChains"),
        (DEPLOYMENT_PATH, "DPUServiceConfiguration", lambda o: o["spec"]["serviceConfiguration"]["serviceDaemonSet"]["labels"].update({"svc.dpu.nvidia.com/x": "y"}), "labels"),
        (DEPLOYMENT_PATH, "DPUServiceTemplate", lambda o: o["spec"]["helmChart"]["source"].update(repoURL="ftp://x"), "repoURL"),
        (DEPLOYMENT_PATH, "DPUServiceIPAM", lambda o: o["spec"].update(subnet={"subnet": "198.51.100.0/24", "gateway": "198.51.100.1", "perNodeIPCount": 4}), "exactly one"),
        (DEPLOYMENT_PATH, "BFB", lambda o: o["spec"].update(versions={"bsp": "4.9", "doca": "", "uefi": "x", "atf": "y"}), "all four"),
        (DEPLOYMENT_PATH, "DPUFlavor", lambda o: o["spec"].update(dpuMode="nic-ish"), "dpuMode"),
        (STANDALONE_PATH, "DPUService", lambda o: o["spec"].pop("security"), "security.privileged must be set"),
        (STANDALONE_PATH, "DPUService", lambda o: o["spec"].pop("serviceID"), "serviceID"),
        (STANDALONE_PATH, "DPUServiceInterface", lambda o: o["spec"]["template"]["spec"]["template"]["spec"].pop("service"), "interfaceType"),
    ],
    ids=lambda p: p if isinstance(p, str) else None,
)
def test_a_broken_dpf_object_is_refused(objs, kind, change, message):
    name = "dpumesh-node-fabric" if kind == "DPUServiceInterface" and objs is STANDALONE_PATH else None
    obj = broken(objs, kind, change, name)
    errors, _ = dpf_rules.validate(obj, KINDS)
    assert errors, f"accepted: {obj}"
    assert any(message in e for e in errors), errors


def selected(objs, kind, labels, where):
    """The objects of `kind` whose labels (at `where`) include `labels`."""
    return [
        o for o in by_kind(objs, kind)
        if labels.items() <= (where(o) or {}).items()
    ]


def interface_labels(o):
    return o["spec"]["template"]["spec"]["template"].get("metadata", {}).get("labels")


def ipam_labels(o):
    return o["spec"].get("metadata", {}).get("labels")


def test_the_deployment_path_refers_to_what_it_ships():
    objs = DEPLOYMENT_PATH
    deployment = one(objs, "DPUDeployment")
    template, config = one(objs, "DPUServiceTemplate"), one(objs, "DPUServiceConfiguration")
    one(objs, "BFB", deployment["spec"]["dpus"]["bfb"])
    one(objs, "DPUFlavor", deployment["spec"]["dpus"]["flavor"])
    name = template["spec"]["deploymentServiceName"]
    assert config["spec"]["deploymentServiceName"] == name
    assert deployment["spec"]["services"][name] == {
        "serviceTemplate": template["metadata"]["name"],
        "serviceConfiguration": config["metadata"]["name"],
    }
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    source = template["spec"]["helmChart"]["source"]
    assert (source["chart"], source["version"]) == (chart["name"], chart["version"])
    interfaces = {i["name"] for i in config["spec"]["interfaces"]}
    ports = [p for s in deployment["spec"]["serviceChains"]["switches"] for p in s["ports"]]
    for port in ports:
        if "serviceInterface" in port:
            labels = port["serviceInterface"]["matchLabels"]
            assert len(selected(objs, "DPUServiceInterface", labels, interface_labels)) == 1, labels
        else:
            assert port["service"]["name"] == name
            assert port["service"]["interface"] in interfaces
            # DPF's SF network asks its chain for the addresses.
            labels = port["service"]["ipam"]["matchLabels"]
            assert len(selected(objs, "DPUServiceIPAM", labels, ipam_labels)) == 1, labels
    # The uplink, the host's PF and the proxy: the host keeps its uplink.
    kinds = sorted(
        interface_labels(selected(objs, "DPUServiceInterface", p["serviceInterface"]["matchLabels"], interface_labels)[0])["uplink"]
        for p in ports if "serviceInterface" in p
    )
    assert kinds == ["p0", "pf0hpf"]


def test_the_standalone_path_refers_to_what_it_ships():
    objs = STANDALONE_PATH
    service = one(objs, "DPUService")
    for name in service["spec"]["interfaces"]:
        iface = one(objs, "DPUServiceInterface", name)
        spec = iface["spec"]["template"]["spec"]["template"]["spec"]
        assert spec["interfaceType"] == "service"
        assert spec["service"]["serviceID"] == service["spec"]["serviceID"]
    chain = one(objs, "DPUServiceChain")
    for switch in chain["spec"]["template"]["spec"]["template"]["spec"]["switches"]:
        for port in switch["ports"]:
            labels = port["serviceInterface"]["matchLabels"]
            assert len(selected(objs, "DPUServiceInterface", labels, interface_labels)) == 1, labels
            if "ipam" in port["serviceInterface"]:
                ipam = port["serviceInterface"]["ipam"]["matchLabels"]
                assert len(selected(objs, "DPUServiceIPAM", ipam, ipam_labels)) == 1


def chart_values(objs):
    """The chart values each path gives DPF (its DPUServiceTemplate, or its
    DPUService)."""
    out = []
    for kind in ("DPUServiceTemplate", "DPUService"):
        for o in by_kind(objs, kind):
            helm = o["spec"].get("helmChart", {})
            if "values" in helm:
                out.append((f"{kind}/{o['metadata']['name']}", helm["values"]))
    return out


@pytest.mark.parametrize("path", ["deployment", "standalone"])
def test_the_doca_path_runs_the_image_built_with_doca(path):
    # A build without the `doca` feature refuses `dataPath.backend: doca` at start:
    # the values that select it name the image scripts/build-images.sh --doca builds.
    objs = DEPLOYMENT_PATH if path == "deployment" else STANDALONE_PATH
    given = chart_values(objs)
    assert given, "the path gives the chart its values"
    for where, values in given:
        assert values["dataPath"]["backend"] == "doca", where
        assert values["image"]["repository"].endswith("/node-doca"), where


def test_a_selector_that_finds_nothing_is_caught():
    objs = [o for o in DEPLOYMENT_PATH if o["metadata"]["name"] != "dpumesh-pf0hpf"]
    with pytest.raises(AssertionError):
        for p in one(objs, "DPUDeployment")["spec"]["serviceChains"]["switches"][0]["ports"]:
            if "serviceInterface" in p:
                labels = p["serviceInterface"]["matchLabels"]
                assert len(selected(objs, "DPUServiceInterface", labels, interface_labels)) == 1


def test_one_command_applies_one_path():
    # `kubectl apply -k deploy/dpf`: the DPUDeployment path only; the standalone
    # DPUService is its own kustomization, never applied with it.
    assert len(by_kind(DEPLOYMENT_PATH, "DPUDeployment")) == 1
    assert not by_kind(DEPLOYMENT_PATH, "DPUService")
    assert len(by_kind(STANDALONE_PATH, "DPUService")) == 1
    assert not by_kind(STANDALONE_PATH, "DPUDeployment")
    # Every manifest is in one path (or the examples, applied by hand).
    listed = set()
    for folder in (DPF, DPF / "common", DPF / "standalone"):
        k = yaml.safe_load((folder / "kustomization.yaml").read_text())
        listed |= {(folder / r).resolve() for r in k["resources"] if r.endswith(".yaml")}
    for path in DPF.rglob("*.yaml"):
        if path.name == "kustomization.yaml" or path.parent.name == "examples":
            continue
        assert path.resolve() in listed, f"{path} is in no kustomization"


def fabric_address(network):
    """The proxy's address in its node's /30: index 1 is the gateway, the one left
    is the proxy's."""
    hosts = list(ipaddress.ip_network(network).hosts())
    assert len(hosts) == 2, f"{network}: a /30 leaves the proxy one address"
    return str(hosts[1])


def test_the_fabric_pool_gives_each_node_the_address_the_mesh_file_names():
    ipam = one(DEPLOYMENT_PATH, "DPUServiceIPAM")["spec"]["network"]
    assert ipam["prefixSize"] == 30 and ipam["gatewayIndex"] == 1
    config = one(DEPLOYMENT_PATH, "DPUServiceConfiguration")
    values = config["spec"]["serviceConfiguration"]["helmChart"]["values"]
    mesh = yaml.safe_load(values["mesh"]["file"])
    assert set(ipam["allocations"]) == set(mesh["nodes"]) == set(values["certs"]["nodes"])
    pool = ipaddress.ip_network(ipam["network"])
    for node, network in ipam["allocations"].items():
        assert ipaddress.ip_network(network).subnet_of(pool), network
        host = mesh["nodes"][node]["fabric"].rsplit(":", 1)[0]
        assert host == fabric_address(network), node
    with pytest.raises(AssertionError):
        fabric_address("192.0.2.8/29")


def test_the_secrets_dpf_needs_are_shown_as_dpf_expects_them(tmp_path):
    text = (DPF / "examples" / "secrets.yaml").read_text()
    valid = kubernetes_validate(tmp_path, text)
    assert valid.returncode == 0, valid.stdout + valid.stderr
    pull, repo = docs(text)
    assert pull["type"] == "kubernetes.io/dockerconfigjson"
    assert pull["metadata"]["labels"] == {"dpu.nvidia.com/image-pull-secret": ""}
    assert repo["metadata"]["labels"] == {"argocd.argoproj.io/secret-type": "repository"}
    assert repo["stringData"]["enableOCI"] == "true"
    template = one(DEPLOYMENT_PATH, "DPUServiceTemplate")
    url = template["spec"]["helmChart"]["source"]["repoURL"]
    assert url == "oci://" + repo["stringData"]["url"]


def test_the_ingress_and_the_dpus_read_the_same_mesh():
    config = one(DEPLOYMENT_PATH, "DPUServiceConfiguration")
    mesh = config["spec"]["serviceConfiguration"]["helmChart"]["values"]["mesh"]
    for key, file in [("file", "mesh.yaml"), ("policy", "policy.yaml")]:
        assert yaml.safe_load((K8S / "mesh" / file).read_text()) == yaml.safe_load(
            mesh[key]
        ), f"deploy/k8s/mesh/{file} differs from the DPF configuration's mesh.{key}"
