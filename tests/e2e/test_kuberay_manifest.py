"""deploy/kuberay/rayservice.yaml, checked by parsing only (no Kubernetes cluster here): it is a
well-formed RayService whose serveConfigV2 passes Ray Serve's own config schema and carries the same
application as deploy/serve_config.yaml."""

from __future__ import annotations

from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


@pytest.fixture(scope="module")
def manifest() -> dict:
    return yaml.safe_load((DEPLOY / "kuberay" / "rayservice.yaml").read_text())


@pytest.fixture(scope="module")
def serve_config() -> dict:
    return yaml.safe_load((DEPLOY / "serve_config.yaml").read_text())


def test_rayservice_shape(manifest):
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == "2.60.0"
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    (workers,) = cluster["workerGroupSpecs"]
    worker = workers["template"]["spec"]["containers"][0]
    for container in (head, worker):
        assert 9000 in {p["containerPort"] for p in container["ports"]}
        assert container["resources"]["requests"] == container["resources"]["limits"]
        assert "readinessProbe" in container
    ports = {p["name"]: p["port"] for p in manifest["spec"]["serveService"]["spec"]["ports"]}
    assert ports["grpc"] == 9000


def test_serve_config_v2_matches_serve_config(manifest, serve_config):
    v2 = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    assert v2["grpc_options"] == serve_config["grpc_options"]
    assert v2["grpc_options"]["port"] == 9000
    assert v2["grpc_options"]["grpc_servicer_functions"] == [
        "lookahead_serve.proto.lookahead.v1.lookahead_pb2_grpc.add_LookaheadServiceServicer_to_server"]
    assert v2["applications"] == serve_config["applications"]
    assert v2["applications"][0]["import_path"] == "lookahead_serve.deploy.ray_app:build_app"
    assert v2["proxy_location"] == serve_config["proxy_location"] == "EveryNode"
    assert v2["http_options"]["host"] == "0.0.0.0" and serve_config["http_options"]["host"] == "127.0.0.1"


def test_both_configs_pass_ray_serves_schema(manifest, serve_config):
    schema = pytest.importorskip("ray.serve.schema")
    from lookahead_serve.deploy.ray_app import SERVICER_FUNCTION

    replicas = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplicas"]
    for config in (serve_config, yaml.safe_load(manifest["spec"]["serveConfigV2"])):
        parsed = schema.ServeDeploySchema.model_validate(config)
        assert parsed.grpc_options.grpc_servicer_functions == [SERVICER_FUNCTION]
        (deployment,) = parsed.applications[0].deployments
        assert deployment.name == "LookaheadDeployment"
        assert deployment.autoscaling_config["max_replicas"] == replicas  # one replica per worker pod
