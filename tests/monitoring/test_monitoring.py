"""Metrics, alert rules and the dashboard, checked with promtool and a real Prometheus server."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from embedding.v1 import embedding_pb2
from tests.conftest import GatedBackend, ServerThread, eventually, request, server_config

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "monitoring"
PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
assert PROMTOOL and PROMETHEUS, "Debian's prometheus package is required: `make setup` installs it"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def sample(text: str, name: str, **labels: str) -> float:
    """The sum of the series of ``name`` that carry ``labels`` (so, without model=, over every model)."""
    return sum(
        float(s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def dashboard_exprs() -> list[tuple[str, str]]:
    dashboard = json.loads((MONITORING / "grafana" / "dashboard.json").read_text())
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p["targets"]]


def alert_rules() -> list[dict[str, str]]:
    groups = yaml.safe_load((MONITORING / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_promtool_checks_config_rules_and_rule_unit_tests() -> None:
    for args in (
        ["check", "config", str(MONITORING / "prometheus.yml")],
        ["check", "rules", str(MONITORING / "alerts.yml")],
        ["test", "rules", str(MONITORING / "alerts_test.yml")],
    ):
        done = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, cwd=MONITORING)
        assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_has_a_firing_unit_test() -> None:
    tested = set(re.findall(r"alertname: (\w+)", (MONITORING / "alerts_test.yml").read_text()))
    alerts = {r["alert"] for r in alert_rules() if "alert" in r}
    assert alerts == tested
    assert len(alerts) >= 6


def test_dashboard_uses_a_datasource_variable_and_covers_the_panels() -> None:
    dashboard = json.loads((MONITORING / "grafana" / "dashboard.json").read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert all(p["datasource"]["uid"] == "${datasource}" for p in dashboard["panels"])
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for needed in ("status code", "p99", "stage", "padding", "queue", "rejections", "tokens/s", "provider", "memory"):
        assert needed in titles
    # A model variable from the served models, and every per-model series filtered by it.
    assert "embed_model_info" in variables["model"]["definition"] and variables["model"]["includeAll"]
    for title, expr in dashboard_exprs():
        for selector in re.findall(r"\b(embed_\w+)\{([^}]*)\}", expr):
            if selector[0] not in PROCESS_WIDE:
                assert 'model=~"$model"' in selector[1], (title, expr)


# The process's own series, with no model label: what every model shares.
PROCESS_WIDE = {
    "embed_requests_in_flight",
    "embed_request_bytes",
    "embed_request_capacity_bytes",
    "embed_http_unsent_bytes",
    "embed_http_unsent_capacity_bytes",
    "embed_http_slow_readers_closed_total",
}


@pytest.fixture(scope="module")
def monitored(tiny_artifacts: Path) -> Iterator[ServerThread]:
    server = ServerThread(server_config(tiny_artifacts, max_queue_tokens=48, max_client_batch_size=16))
    yield server
    server.stop()


def test_scrape_is_clean_under_promtool_check_metrics(monitored: ServerThread) -> None:
    monitored.stub().Embed(request("warm the histograms", "with two inputs"))
    text = scrape(monitored.server.metrics_port)
    done = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "" and done.stderr.strip() == "", done.stdout + done.stderr
    for name in ("embed_requests_total", "embed_queue_duration_seconds_bucket", "process_resident_memory_bytes"):
        assert name in text


def test_counters_move_by_the_right_amounts(monitored: ServerThread) -> None:
    port = monitored.server.metrics_port
    before = scrape(port)
    stub = monitored.stub()
    token_total = 0
    for i in range(5):
        token_total += stub.Embed(request(f"request {i}", "second input", "third input")).total_tokens
    for _ in range(2):
        with pytest.raises(grpc.RpcError):
            stub.Embed(request("ok", ""))
    # An aborted RPC's status reaches the client a moment before the handler's bookkeeping finishes.
    end = time.monotonic() + 5
    while True:
        after = scrape(port)
        settled = sample(after, "embed_requests_total", method="Embed", code="INVALID_ARGUMENT") - sample(
            before, "embed_requests_total", method="Embed", code="INVALID_ARGUMENT"
        )
        if settled >= 2 or time.monotonic() > end:
            break
        time.sleep(0.05)

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert delta("embed_requests_total", method="Embed", code="OK") == 5
    assert delta("embed_requests_total", method="Embed", code="INVALID_ARGUMENT") == 2
    assert delta("embed_rejections_total", reason="invalid") == 2
    assert delta("embed_rejections_total", reason="invalid", model="wordnet-encoder") == 2  # refused by that model
    assert delta("embed_inputs_total") == 15
    assert delta("embed_tokens_total") == token_total
    assert delta("embed_request_duration_seconds_count", method="Embed") == 7
    assert delta("embed_tokenize_duration_seconds_count") == 5
    assert delta("embed_queue_duration_seconds_count") == 15
    assert sample(after, "embed_queue_capacity_tokens") == 48
    warm_up_budget = monitored.stub().Info(embedding_pb2.InfoRequest()).max_batch_tokens
    assert sample(after, "embed_batch_token_budget") == warm_up_budget  # light traffic: never slower


def drive_mixed_traffic(server: ServerThread) -> None:
    """OK requests, invalid ones, and overload (a held backend lets the small queue fill)."""
    stub = server.stub()
    for i in range(20):
        stub.Embed(request(*[f"text {i} {j}" for j in range(1 + i % 4)]))
    list(stub.EmbedStream(iter([request("streamed one"), request("streamed two")])))
    for bad in (request(), request("fine", "   ")):
        with pytest.raises(grpc.RpcError):
            stub.Embed(bad)
    gate = GatedBackend(server.server)
    try:
        futures = [stub.Embed.future(request(f"queued request number {i} with several words")) for i in range(8)]

        def refused_while_one_is_held() -> bool:  # a done future before the release is a refusal
            return gate.held >= 1 and any(f.done() for f in futures)

        eventually(refused_while_one_is_held, 10, "a batch held and a request refused")
        gate.release()
        codes = []
        for f in futures:
            try:
                f.result()
                codes.append("OK")
            except grpc.RpcError as e:
                codes.append(e.code().name)
        assert "RESOURCE_EXHAUSTED" in codes and "OK" in codes
    finally:
        gate.remove()


class Prometheus:
    def __init__(self, tmp: Path, metrics_port: int) -> None:
        self.port = free_port()
        shutil.copy(MONITORING / "alerts.yml", tmp / "alerts.yml")
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": ["alerts.yml"],
            "scrape_configs": [
                {"job_name": "embedding", "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}]}
            ],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.process = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._wait_ready()

    def _wait_ready(self) -> None:
        end = time.monotonic() + 30
        while time.monotonic() < end:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError("Prometheus did not become ready")

    def query(self, expr: str) -> dict:  # type: ignore[type-arg]
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:  # 400 for a query that does not parse
            return json.loads(e.read())

    def has_data(self, expr: str, timeout: float = 15.0) -> bool:
        """Polls: scrapes and rule evaluations run on Prometheus' own clock, slower on a busy machine."""
        end = time.monotonic() + timeout
        while True:
            if self.query(expr).get("data", {}).get("result"):
                return True
            if time.monotonic() > end:
                return False
            time.sleep(0.5)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)


def grafana_to_promql(expr: str) -> str:
    return expr.replace('"$job"', '"embedding"').replace('"$model"', '".*"').replace("$__rate_interval", "1m")


def test_dashboard_and_alert_queries_return_data_from_a_real_prometheus(
    monitored: ServerThread, tmp_path: Path
) -> None:
    prometheus = Prometheus(tmp_path, monitored.server.metrics_port)
    try:
        # Two scrapes before the traffic, so rate() has a baseline; then one that saw its last part.
        assert prometheus.has_data('count_over_time(up{job="embedding"}[1m]) >= 2'), "Prometheus never scraped"
        drive_mixed_traffic(monitored)
        assert prometheus.has_data('embed_requests_total{code="RESOURCE_EXHAUSTED"} > 0'), "the overload never scraped"

        empty = []
        for title, expr in dashboard_exprs():
            result = prometheus.query(grafana_to_promql(expr))
            assert result["status"] == "success", (title, expr, result)
            if not prometheus.has_data(grafana_to_promql(expr)):
                empty.append((title, expr))
        assert not empty, f"dashboard queries returning nothing: {empty}"

        recorded = set()
        for rule in alert_rules():
            result = prometheus.query(rule["expr"])
            assert result["status"] == "success", (rule, result)  # every expression parses
            if "record" in rule:
                recorded.add(rule["record"])
                assert prometheus.has_data(rule["expr"]), f"{rule['record']} returns nothing"
                # the rule really runs in Prometheus
                assert prometheus.has_data(rule["record"]), f"{rule['record']} was never evaluated"
        for rule in alert_rules():
            if "alert" in rule:
                signals = set(re.findall(r"[a-z_]+:[a-z0-9_:]+|\bup\b", rule["expr"]))
                assert signals and signals <= recorded | {"up"}, rule["expr"]
                for signal in signals:
                    assert prometheus.has_data(signal), f"{rule['alert']}: {signal} has no data"

        scraped = scrape(monitored.server.metrics_port)
        ok = prometheus.query('embed_requests_total{method="Embed", code="OK"}')["data"]["result"]
        assert float(ok[0]["value"][1]) == sample(scraped, "embed_requests_total", method="Embed", code="OK")
        overloaded = prometheus.query('embed_rejections_total{reason="overloaded"}')["data"]["result"]
        assert float(overloaded[0]["value"][1]) >= 1
    finally:
        prometheus.stop()
