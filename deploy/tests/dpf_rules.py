"""DPF's CRDs as the API server applies them at creation: each field's default
filled in, the structural schema with unknown fields refused (as `kubectl apply
--validate=strict` does), then every CEL rule (`x-kubernetes-validations`) that
applies when an object is created, evaluated with cel-python.

Rules that compare with `oldSelf` are transition rules and run on update only; the
one rule marked `optionalOldSelf` runs on create with no old object, which is what
replacing `oldSelf.hasValue()` by `false` models."""

import copy
import json

import celpy
import jsonschema
import yaml
from celpy import celtypes

from conftest import crds_dir

ENV = celpy.Environment()


def crds():
    """{kind: (group, openAPIV3Schema)} for every CRD in the reference folder."""
    out = {}
    for path in sorted(crds_dir().glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
        out[crd["spec"]["names"]["kind"]] = (
            crd["spec"]["group"],
            version["schema"]["openAPIV3Schema"],
        )
    return out


def strict(schema):
    """The schema refusing unknown fields wherever it does not preserve them."""
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


def defaults(schema, value):
    """Fills `default`s in place, as the API server does before validating."""
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                defaults(sub, value[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict) and not schema.get("properties"):
            for key in value:
                defaults(extra, value[key])
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            defaults(schema["items"], item)


def _rules(schema, value, path, out):
    if value is None:
        return
    for rule in schema.get("x-kubernetes-validations") or []:
        out.append((path, rule, value))
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in value:
                _rules(sub, value[key], f"{path}.{key}", out)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict) and not schema.get("properties"):
            for key in value:
                _rules(extra, value[key], f"{path}[{key}]", out)
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            _rules(schema["items"], item, f"{path}[{i}]", out)


def cel_failures(schema, obj):
    """[(path, message)] for each creation-time CEL rule `obj` breaks, and how many
    rules were evaluated."""
    found = []
    _rules(schema, obj, "", found)
    failures, evaluated = [], 0
    for path, rule, value in found:
        expr = rule["rule"]
        if "oldSelf" in expr:
            if not rule.get("optionalOldSelf"):
                continue
            expr = expr.replace("oldSelf.hasValue()", "false")
        evaluated += 1
        message = rule.get("message") or rule.get("messageExpression")
        try:
            program = ENV.program(ENV.compile(expr))
            result = program.evaluate({"self": celpy.json_to_cel(value)})
        except Exception as e:  # a rule that cannot evaluate is a failure too
            failures.append((path or "<root>", f"{message} (error: {e})"))
            continue
        if result != celtypes.BoolType(True):
            failures.append((path or "<root>", message))
    return failures, evaluated


def validate(obj, kinds=None):
    """Errors (empty when valid) of `obj` against its CRD: group and kind, the
    strict schema with defaults filled, and the CEL rules; and how many CEL rules
    ran."""
    kinds = kinds or crds()
    kind = obj.get("kind")
    if kind not in kinds:
        return [f"no CRD for kind {kind!r}"], 0
    group, schema = kinds[kind]
    obj = copy.deepcopy(obj)
    errors = []
    if obj.get("apiVersion") != f"{group}/v1alpha1":
        errors.append(f"apiVersion {obj.get('apiVersion')!r}, not {group}/v1alpha1")
    meta = obj.get("metadata") or {}
    if not meta.get("name") or not meta.get("namespace"):
        errors.append("metadata needs a name and a namespace")
    defaults(schema, obj)
    checked = strict(copy.deepcopy(schema))
    checked["properties"]["metadata"] = {"type": "object"}
    checked["properties"]["apiVersion"] = {"type": "string"}
    checked["properties"]["kind"] = {"type": "string"}
    checked["required"] = ["apiVersion", "kind", "metadata", "spec"]
    validator = jsonschema.Draft7Validator(checked)
    for e in validator.iter_errors(obj):
        where = "/".join(str(p) for p in e.absolute_path)
        errors.append(f"{where}: {e.message}")
    failures, evaluated = cel_failures(schema, obj)
    errors += [f"{path}: {message}" for path, message in failures]
    return errors, evaluated


def to_json(obj):
    return json.loads(json.dumps(obj))
