"""KServe manifests: valid against KServe's own CRD schemas, offline and strictly, and consistent with the server.

The schemas are the served versions' ``openAPIV3Schema`` from kserve/kserve's ``config/crd/full``
(deploy/kserve/schemas/extract.py). Validation is strict as ``kubectl --validate=strict`` is: a field the
schema does not declare is an error (the API server would drop it silently).
"""

from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from server.config import ServerConfig, parse_config

KSERVE = Path(__file__).resolve().parents[2] / "deploy" / "kserve"
SCHEMAS = {"ServingRuntime": "servingruntime.v1alpha1", "InferenceService": "inferenceservice.v1beta1"}


def strict(schema: Any) -> Any:
    """The schema with undeclared fields refused wherever an object declares its fields."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    open_ended = "additionalProperties" in out or out.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in out and not open_ended:
        out["additionalProperties"] = False
    return out


def validator(kind: str) -> jsonschema.Draft7Validator:
    text = gzip.decompress((KSERVE / "schemas" / f"{SCHEMAS[kind]}.json.gz").read_bytes())
    return jsonschema.Draft7Validator(strict(json.loads(text)))


def manifest(name: str) -> dict[str, Any]:
    return yaml.safe_load((KSERVE / name).read_text())


def errors(doc: dict[str, Any]) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator(doc["kind"]).iter_errors(doc)]


@pytest.mark.parametrize("name", ["servingruntime.yaml", "inferenceservice.yaml"])
def test_kserve_manifests_are_valid_against_kserves_crd_schemas(name: str) -> None:
    doc = manifest(name)
    assert doc["apiVersion"] == f"serving.kserve.io/{SCHEMAS[doc['kind']].split('.')[1]}"
    assert errors(doc) == []


def test_the_strict_validation_refuses_a_misspelt_field_and_a_wrong_type() -> None:
    runtime = manifest("servingruntime.yaml")
    misspelt = copy.deepcopy(runtime)
    misspelt["spec"]["protocolVersion"] = misspelt["spec"].pop("protocolVersions")  # singular: not a field here
    assert any("protocolVersion" in e for e in errors(misspelt))
    wrong = copy.deepcopy(runtime)
    wrong["spec"]["containers"][0]["ports"][0]["containerPort"] = "50051"
    assert any("containerPort" in e for e in errors(wrong))


def test_the_runtime_serves_the_open_inference_protocol_on_the_servers_grpc_port() -> None:
    runtime, service = manifest("servingruntime.yaml"), manifest("inferenceservice.yaml")
    (container,) = runtime["spec"]["containers"]
    assert container["name"] == "kserve-container"  # the name KServe merges the predictor's settings into
    assert "grpc-v2" in runtime["spec"]["protocolVersions"]
    (port,) = container["ports"]
    assert port == {"name": "h2c", "containerPort": ServerConfig().port, "protocol": "TCP"}  # h2c: gRPC routing
    assert container["readinessProbe"]["grpc"]["port"] == port["containerPort"]
    # The args are the server's own flags: with KServe's {{.Name}} filled in, parsed as `python -m server`
    # would; the model is served under the InferenceService's name from KServe's model folder.
    name = service["metadata"]["name"]
    config = parse_config([a.replace("{{.Name}}", name) for a in container["args"]], environ={})
    assert config.model_dirs() == [(name, "/mnt/models")]
    model = service["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"] and model["protocolVersion"] == "grpc-v2"
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert model["ports"] == container["ports"]
