"""docker-compose's observability services (issue 14, part 3): Prometheus's configuration passes
`promtool` (Debian's prometheus package), every file the services mount is in the repository, the
dashboard's data source is the provisioned one, and the OTel collector's pipelines use only what it
defines. (The dashboard's queries are run by a real Prometheus in tests/e2e/operations/test_metrics_e2e.py.)"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[3]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_prometheus_config_passes_promtool_and_scrapes_the_gateway() -> None:
    promtool = shutil.which("promtool")
    assert promtool, "Debian's prometheus package (.ci/run installs it)"
    r = subprocess.run([promtool, "check", "config", str(ROOT / "deploy/prometheus.yml")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    config = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    extproc = COMPOSE["services"]["extproc"]["command"]
    status = extproc[extproc.index("--status-listen") + 1].rpartition(":")[2]
    assert f"extproc:{status}" in targets  # the status port, where /metrics is
    # Envoy's own metrics, from the stats listener the compose render adds (not the loopback admin).
    envoy = yaml.safe_load((ROOT / "envoy/envoy.compose.yaml").read_text())
    (stats,) = [lst for lst in envoy["static_resources"]["listeners"] if lst["name"] == "envoy_stats"]
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "envoy"]
    assert job["metrics_path"] == "/stats/prometheus"
    assert job["static_configs"][0]["targets"] == [f"envoy:{stats['address']['socket_address']['port_value']}"]


def test_every_mounted_file_exists_and_the_dashboard_uses_the_provisioned_source() -> None:
    for name in ("prometheus", "grafana", "otel-collector"):
        for volume in COMPOSE["services"][name].get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name} mounts {source}"
    source = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yaml").read_text())
    uid = source["datasources"][0]["uid"]
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/llmgw.json").read_text())
    assert {p["datasource"]["uid"] for p in dashboard["panels"]} == {uid}
    assert all(p["targets"] and p["targets"][0]["expr"] for p in dashboard["panels"])


def test_the_collectors_pipelines_use_what_it_defines() -> None:
    config = yaml.safe_load((ROOT / "deploy/otel-collector.yaml").read_text())
    for pipeline in config["service"]["pipelines"].values():
        for kind in ("receivers", "processors", "exporters"):
            assert set(pipeline.get(kind, [])) <= set(config.get(kind) or {}), (kind, pipeline)
    # Traces go to the collector when the operator names it (it runs under the `observability` profile).
    assert COMPOSE["services"]["extproc"]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "${LLMGW_OTLP_ENDPOINT-}"
    assert COMPOSE["services"]["otel-collector"]["profiles"] == ["observability"]
    assert "4317" in config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
