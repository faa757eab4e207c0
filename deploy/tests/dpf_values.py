"""The values DPF hands the chart, computed from our DPF objects as DPF's
controllers compute them (NVIDIA/doca-platform, internal/dpuservice/controllers:
the DPUService controller's ArgoCD values, and the DPUDeployment controller's
DPUService), so the chart is rendered with what DPF really passes:

- DPUService: `MergeMaps({"serviceDaemonSet": sds}, spec.helmChart.values)` (the
  first map wins), where sds carries the object's serviceDaemonSet with
  - labels + `svc.dpu.nvidia.com/service: <serviceID>`,
  - annotations + `k8s.v1.cni.cncf.io/networks` (a sorted JSON list of
    `{"name": network, "interface": name}` for the interfaces),
  - resources + `nvidia.com/bf_sf: "<n>"` (n SF interfaces on an SF network).
- DPUDeployment: the configuration's values over the template's; the configuration's
  serviceDaemonSet; labels + `svc.dpu.nvidia.com/dpudeployment-service: <name>`;
  serviceID `dpudeployment_<deployment>_<service>`; a nodeSelector on the labels DPF
  puts on the DPU nodes of that DPUService version; then the DPUService rules above.
"""

import copy
import json

# DPF's own SF network on br-sfc (a DPUServiceNAD of resourceType sf).
SF_NETWORKS = {"mybrsfc"}
SF_RESOURCE = "nvidia.com/bf_sf"


def merge_maps(first, second):
    """DPF's MergeMaps: `second` under `first`, recursively; `first` wins."""
    out = copy.deepcopy(second)
    for key, value in first.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_maps(value, out[key])
        else:
            out[key] = copy.deepcopy(value)
    return out


def for_dpuservice(service, interfaces):
    """The values of DPUService `service`; `interfaces` maps each name in
    spec.interfaces to its DPUServiceInterface."""
    spec = service["spec"]
    given = spec.get("serviceDaemonSet") or {}
    sds = {k: copy.deepcopy(v) for k, v in given.items() if v}
    labels = dict(given.get("labels") or {})
    labels["svc.dpu.nvidia.com/service"] = spec["serviceID"]
    sds["labels"] = labels
    networks, sfs = [], 0
    for name in spec.get("interfaces") or []:
        iface = interfaces[name]["spec"]["template"]["spec"]["template"]["spec"]
        assert iface["interfaceType"] == "service", name
        networks.append(
            {"name": iface["service"]["network"], "interface": iface["service"]["interfaceName"]}
        )
        sfs += iface["service"]["network"] in SF_NETWORKS
    if networks:
        annotations = dict(given.get("annotations") or {})
        networks.sort(key=lambda n: (n["name"], n["interface"]))
        annotations["k8s.v1.cni.cncf.io/networks"] = json.dumps(
            networks, separators=(",", ":")
        )
        sds["annotations"] = annotations
    if sfs:
        resources = dict(given.get("resources") or {})
        resources[SF_RESOURCE] = str(sfs)
        sds["resources"] = resources
    return merge_maps({"serviceDaemonSet": sds}, spec["helmChart"].get("values") or {})


def for_dpudeployment(deployment, template, configuration, version="x7k2p"):
    """The values of the DPUService DPUDeployment `deployment` makes for its service
    (`version`: the suffix DPF gives that DPUService's name)."""
    name = template["spec"]["deploymentServiceName"]
    namespace = deployment["metadata"]["namespace"]
    dep = deployment["metadata"]["name"]
    conf = configuration["spec"]["serviceConfiguration"]
    values = merge_maps(
        conf.get("helmChart", {}).get("values") or {},
        template["spec"]["helmChart"].get("values") or {},
    )
    sds = copy.deepcopy(conf.get("serviceDaemonSet") or {})
    sds.setdefault("labels", {})["svc.dpu.nvidia.com/dpudeployment-service"] = name
    sds["nodeSelector"] = {
        "nodeSelectorTerms": [
            {
                "matchExpressions": [
                    {
                        "key": f"svc.dpu.nvidia.com/dpuservice-{name}-version",
                        "operator": "In",
                        "values": [f"{name}-{version}"],
                    },
                    {
                        "key": "svc.dpu.nvidia.com/owned-by-dpudeployment",
                        "operator": "In",
                        "values": [f"{namespace}_{dep}"],
                    },
                ]
            }
        ]
    }
    # The DPUServiceInterfaces the DPUDeployment makes from the configuration.
    interfaces = {
        f"{name}-{i['name']}": {
            "spec": {
                "template": {
                    "spec": {
                        "template": {
                            "spec": {
                                "interfaceType": "service",
                                "service": {"network": i["network"], "interfaceName": i["name"]},
                            }
                        }
                    }
                }
            }
        }
        for i in configuration["spec"].get("interfaces") or []
    }
    service = {
        "spec": {
            "serviceID": f"dpudeployment_{dep}_{name}",
            "interfaces": sorted(interfaces),
            "serviceDaemonSet": sds,
            "helmChart": {"values": values},
        }
    }
    return for_dpuservice(service, interfaces)
