"""Kubernetes manifests: schema-valid offline, and consistent with each other and with the server."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonpatch
import kubernetes_validate
import pytest
import yaml

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
K8S_GPU = K8S.parent / "k8s-gpu"
KUBERNETES_VERSION = "1.31.0"
KUSTOMIZATION = "kustomization.yaml"


def documents() -> list[dict]:  # type: ignore[type-arg]
    paths = sorted(p for p in K8S.glob("*.yaml") if p.name != KUSTOMIZATION)
    return [doc for path in paths for doc in yaml.safe_load_all(path.read_text()) if doc]


def kustomization(folder: Path) -> dict:  # type: ignore[type-arg]
    return yaml.safe_load((folder / KUSTOMIZATION).read_text())  # type: ignore[no-any-return]


def gpu_documents() -> list[dict]:  # type: ignore[type-arg]
    """deploy/k8s-gpu/ as `kubectl kustomize` renders it: deploy/k8s/'s documents, each JSON 6902 patch applied
    to its target."""
    overlay = kustomization(K8S_GPU)
    assert overlay["resources"] == ["../k8s"]
    docs = copy.deepcopy(documents())
    for patch in overlay["patches"]:
        kind, name = patch["target"]["kind"], patch["target"]["name"]
        (index,) = [i for i, d in enumerate(docs) if d["kind"] == kind and d["metadata"]["name"] == name]
        docs[index] = jsonpatch.apply_patch(docs[index], yaml.safe_load((K8S_GPU / patch["path"]).read_text()))
    return docs


def by_kind(kind: str) -> list[dict]:  # type: ignore[type-arg]
    return [d for d in documents() if d["kind"] == kind]


@pytest.mark.parametrize("doc", [d for d in documents() if d["kind"] != "PodMonitor"], ids=lambda d: d["kind"])
def test_core_manifests_pass_strict_schema_validation(doc: dict) -> None:  # type: ignore[type-arg]
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("doc", [d for d in gpu_documents() if d["kind"] != "PodMonitor"], ids=lambda d: d["kind"])
def test_the_gpu_overlays_core_manifests_pass_strict_schema_validation(doc: dict) -> None:  # type: ignore[type-arg]
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_kubectl_apply_k_applies_every_manifest_of_the_folder() -> None:
    assert sorted(kustomization(K8S)["resources"]) == sorted(
        p.name for p in K8S.glob("*.yaml") if p.name != KUSTOMIZATION
    )


def test_the_gpu_overlay_asks_for_a_gpu_requires_cuda_and_scrapes_every_worker() -> None:
    docs = gpu_documents()
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["EMBED_PROVIDER"] == "cuda"  # a pod where CUDA does not load exits 2 instead of serving on its CPU
    resources = container["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1 and resources["requests"] == resources["limits"]
    assert container["image"].endswith("-cuda")  # built with --build-arg EXTRAS='[cuda]'
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    metrics = {p["name"]: p["containerPort"] for p in container["ports"] if p["name"].startswith("metrics")}
    assert sorted(metrics.values()) == [9464 + i for i in range(int(env["EMBED_WORKERS"]))]  # worker i: 9464 + i
    (monitor,) = [d for d in docs if d["kind"] == "PodMonitor"]
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    assert sorted(e["port"] for e in endpoints) == sorted(metrics)
    assert all({"targetLabel": "job", "replacement": "embedding"} in e["relabelings"] for e in endpoints)
    base = next(d for d in documents() if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    for kept in ("args", "readinessProbe", "livenessProbe", "startupProbe", "securityContext"):
        assert container[kept] == base[kept]  # the drain, probes and security of the CPU deployment


def test_deployment_probes_drain_and_resources_fit_the_server() -> None:
    (deployment,) = by_kind("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": 50051, "http": 8080, "metrics": 9464, "health": 50052}  # the server's defaults + health
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["EMBED_HEALTH_PORT"] == "50052"  # the plaintext health-only port the probes reach, TLS or not
    # Connections renewed, so clients balancing over the headless Service's DNS find pods the autoscaler adds.
    age = float(env["EMBED_GRPC_MAX_CONNECTION_AGE_SECONDS"])
    assert 0 < age <= 600
    # ... and closed under their calls after a grace, so a client that takes no answer holds its calls' places
    # for minutes, not for as long as it keeps the connection.
    assert 0 < age + float(env["EMBED_GRPC_MAX_CONNECTION_AGE_GRACE_SECONDS"]) <= 600
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["grpc"]["port"] == ports["health"]  # native gRPC probes on the health service
    assert container["readinessProbe"]["grpc"]["service"] == "embedding.v1.Embedder"
    args = container["args"]
    grace = float(args[args.index("--grace-seconds") + 1])
    delay = float(args[args.index("--drain-delay-seconds") + 1])
    assert pod["terminationGracePeriodSeconds"] > delay + grace  # Kubernetes never cuts a drain short
    assert container["resources"]["requests"] and container["resources"]["limits"]
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 10001
    (spread,) = pod["topologySpreadConstraints"]  # replicas on different nodes where there are several
    assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["whenUnsatisfiable"] == "ScheduleAnyway"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert spread["labelSelector"]["matchLabels"].items() <= labels.items()


def test_services_hpa_disruption_budget_and_pod_monitor_point_at_the_deployment() -> None:
    (deployment,) = by_kind("Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    services = by_kind("Service")
    assert {s["metadata"]["name"] for s in services} == {"embedding", "embedding-headless"}
    for service in services:
        assert service["spec"]["selector"].items() <= labels.items()
    assert [s for s in services if s["spec"].get("clusterIP") == "None"]  # headless, for client-side LB
    (hpa,) = by_kind("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    (budget,) = by_kind("PodDisruptionBudget")  # node drains evict one pod at a time, never the last one serving
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert budget["spec"]["maxUnavailable"] == 1 < min(hpa["spec"]["minReplicas"], deployment["spec"]["replicas"])
    (monitor,) = by_kind("PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    container_ports = {p["name"] for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert endpoint["port"] in container_ports and endpoint["path"] == "/metrics"
    assert {"targetLabel": "job", "replacement": "embedding"} in endpoint["relabelings"]  # alerts use job=embedding


def test_dockerfile_healthcheck_asks_the_plaintext_health_port_the_image_opens() -> None:
    text = (K8S.parent / "Dockerfile").read_text()
    assert "EMBED_HEALTH_PORT=50052" in text and "EXPOSE 50051 8080 9464 50052" in text
    assert "EMBED_HTTP_PORT=8080" in text
    healthcheck = text[text.index("HEALTHCHECK") :].split("\n\n")[0]
    assert '"--target", "127.0.0.1:50052"' in healthcheck and '"health"' in healthcheck


def test_the_image_and_the_deployment_follow_the_memory_sizing_rule() -> None:
    """The serving image installs jemalloc and sets the allocator settings the server would otherwise restart
    itself for (server/memory.py, ``allocator_settings``); the pod's memory limit is the one the flood test
    holds peak RSS to 75% of (tests/reliability/test_flood.py)."""
    from server.memory import JEMALLOC_SETTINGS, MALLOC_SETTINGS
    from tests.reliability.test_flood import LIMIT_MIB

    text = (K8S.parent / "Dockerfile").read_text()
    serve = text[text.index(" AS serve\n") : text.index(" AS artifacts\n")]
    for name, value in {**MALLOC_SETTINGS, **JEMALLOC_SETTINGS}.items():
        assert f"{name}={value}" in serve
    assert 'apt-get install -y --no-install-recommends "libjemalloc2=5.3.*"' in serve
    (deployment,) = by_kind("Deployment")
    resources = deployment["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["limits"]["memory"] == f"{LIMIT_MIB // 1024}Gi"
    # Requests equal to the limit: the budgets assume the limit's memory is really there.
    assert resources["requests"]["memory"] == resources["limits"]["memory"]


def test_the_image_with_a_model_builds_and_serves_what_make_run_does() -> None:
    """`--target serve-with-model` bakes all-MiniLM-L6-v2 (the default) and the distilled student, the two models
    `make run` serves in the same order, not the from-scratch recipe that `python -m model.train` gives alone."""
    text = (K8S.parent / "Dockerfile").read_text()
    build = text[text.index("AS artifacts") : text.index("AS serve-with-model")]
    assert build.index("-m export.pretrained --out artifacts/minilm") < build.index("-m model.train")
    assert "-m model.train --out-dir artifacts --teacher auto" in build
    image = text[text.index("AS serve-with-model") :]
    assert "ENV EMBED_MODEL=/models/minilm,/models" in image
    makefile = (K8S.parent.parent / "Makefile").read_text()
    assert "-m server --model $(ARTIFACTS)/minilm --model $(ARTIFACTS)" in makefile
    for source, folder in (("/src/artifacts/", "/models/"), ("/src/artifacts/minilm/", "/models/minilm/")):
        copy = next(line for line in image.splitlines() if line.startswith("COPY") and line.endswith(f" {folder}"))
        served = (
            "model.onnx",
            "model.cpu.onnx",
            "tokenizer.json",
            "manifest.json",
        )  # the CPU graph: server/backend/ort.py
        assert {f"{source}{name}" for name in served} <= set(copy.split())


def test_every_docker_run_shown_publishes_the_ports_clients_use() -> None:
    """gRPC, HTTP and metrics: each `docker run` of our image in the docs and the Dockerfile publishes every
    port the image exposes except the health-only one, which its own HEALTHCHECK asks from inside."""
    dockerfile = (K8S.parent / "Dockerfile").read_text()
    exposed = set(next(line for line in dockerfile.splitlines() if line.startswith("EXPOSE")).split()[1:])
    client_ports = exposed - {"50052"}
    docs = "".join(path.read_text() for path in sorted((K8S.parents[1] / "docs" / "guides").glob("*.md")))
    runs = [line for line in (dockerfile + docs).splitlines() if "docker run" in line and "embedding-service" in line]
    assert len(runs) >= 2, runs
    for run in runs:
        words = run.split()
        published = {words[i + 1].rsplit(":", 1)[1] for i, word in enumerate(words) if word == "-p"}
        assert client_ports <= published, f"{run!r} does not publish {sorted(client_ports - published)}"
