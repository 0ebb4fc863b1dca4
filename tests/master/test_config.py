"""Master and frontend-routing settings from the environment: parsed once, bad values named."""
from __future__ import annotations

import json

import pytest

from frontend.config import FrontendConfig
from launcher.launch import _check_configs
from kvyard.roles import Role
from master.config import BackendEndpoint, DnsTarget, MasterConfig


def test_master_env() -> None:
    cfg = MasterConfig.from_env({"START_PORT": "9000", "MASTER_BACKENDS": "10.0.0.1:8089, big@10.0.0.2:9001",
                                 "MASTER_BACKEND_DNS": "kv-backend.ns.svc:8089", "MODEL_NAME": "small"})
    assert cfg.port == 9000 and cfg.advertise_address == "127.0.0.1:9000"
    assert cfg.static_backends == (BackendEndpoint("10.0.0.1", 8089, 8093, "small"),
                                   BackendEndpoint("10.0.0.2", 9001, 9005, "big"))
    assert cfg.dns_targets == (DnsTarget("kv-backend.ns.svc", 8089, "small"),)
    assert cfg.expire_s == 3.0 and cfg.poll_interval_s == 0.15


@pytest.mark.parametrize("env, needle", [
    ({"MASTER_BACKENDS": "10.0.0.1"}, "MASTER_BACKENDS"),
    ({"MASTER_BACKENDS": "10.0.0.1:http"}, "10.0.0.1:http"),
    ({"MASTER_BACKEND_DNS": "svc:99999"}, "MASTER_BACKEND_DNS"),
    ({"MASTER_POLL_INTERVAL_MS": "fast"}, "MASTER_POLL_INTERVAL_MS"),
    ({"MASTER_IMBALANCE_PCT": "50"}, "MASTER_IMBALANCE_PCT"),
])
def test_master_env_errors_name_the_value(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        MasterConfig.from_env(env)


def test_launcher_validates_the_master_role() -> None:
    _check_configs(Role.MASTER, {"MASTER_BACKENDS": "127.0.0.1:8089"})
    with pytest.raises(ValueError, match="MASTER_BACKENDS"):
        _check_configs(Role.MASTER, {"MASTER_BACKENDS": "nonsense"})
    with pytest.raises(ValueError, match="FRONTEND_SERVER_COUNT"):
        _check_configs(Role.PDFUSION, {"FRONTEND_SERVER_COUNT": "3"})


def test_frontend_master_settings() -> None:
    plain = FrontendConfig.from_env({"START_PORT": "7000"})
    assert plain.master_address == "" and plain.fallback_addresses == ("127.0.0.1:7001",)
    rtp = {"service_id": "x", "master_endpoint": {"type": "VipServer", "address": "10.0.0.9:16000",
                                                  "protocol": "http", "path": "/"}, "use_local": True,
           "backend_addresses": ["10.0.0.1:8089", "10.0.0.2:8089"]}
    cfg = FrontendConfig.from_env({"MODEL_SERVICE_CONFIG": json.dumps(rtp), "BLOCK_SIZE": "32"})
    assert cfg.master_address == "10.0.0.9:16000" and cfg.block_size == 32
    assert cfg.fallback_addresses == ("10.0.0.1:8089", "10.0.0.2:8089")
    cfg = FrontendConfig.from_env({"MASTER_ADDRESS": "m:1", "BACKEND_ADDRESSES": "a:1,b:2"})
    assert (cfg.master_address, cfg.fallback_addresses) == ("m:1", ("a:1", "b:2"))


@pytest.mark.parametrize("raw", ["[1]", "{bad", '{"master_endpoint": {"address": 5}}',
                                 '{"backend_addresses": "a:1"}'])
def test_frontend_model_service_config_errors(raw: str) -> None:
    with pytest.raises(ValueError, match="MODEL_SERVICE_CONFIG"):
        FrontendConfig.from_env({"MODEL_SERVICE_CONFIG": raw})


def test_every_model_service_config_key_takes_effect() -> None:
    """RTP-LLM's keys: protocol and path make the master's URL, use_local=false drops the direct fallback,
    service_id names the service; the seed's example as written works."""
    def cfg(**service: object) -> FrontendConfig:
        return FrontendConfig.from_env({"START_PORT": "7000", "MODEL_SERVICE_CONFIG": json.dumps(service)})

    seed = cfg(service_id="test", use_local=True, master_endpoint={
        "type": "VipServer", "address": "127.0.0.1:16000", "protocol": "http", "path": "/"})
    assert (seed.master_address, seed.fallback_addresses, seed.service_id) == (
        "127.0.0.1:16000", ("127.0.0.1:7001",), "test")
    https = cfg(master_endpoint={"address": "m:443", "protocol": "https", "path": "/rtp/"})
    assert https.master_address == "https://m:443/rtp"
    only_master = cfg(master_endpoint={"address": "m:1"}, use_local=False)
    assert only_master.fallback_addresses == ()


@pytest.mark.parametrize("service,needle", [
    ({"service_idd": "x"}, "MODEL_SERVICE_CONFIG.service_idd is not supported"),
    ({"master_endpoint": {"address": "m:1", "port": 1}}, "master_endpoint.port is not supported"),
    ({"master_endpoint": {"address": "m:1", "type": "Nacos"}}, "master_endpoint.type"),
    ({"master_endpoint": {"address": "m:1", "protocol": "grpc"}}, "master_endpoint.protocol"),
    ({"master_endpoint": {"address": "m:1", "path": "x"}}, "master_endpoint.path"),
    ({"use_local": "yes"}, "use_local"),
    ({"use_local": False}, "use_local=false needs a master_endpoint"),
    ({"service_id": 5}, "service_id"),
])
def test_model_service_config_refuses_by_key(service: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        FrontendConfig.from_env({"MODEL_SERVICE_CONFIG": json.dumps(service)})


def test_internal_ports_bind_loopback_by_default() -> None:
    """Backend gRPC/HTTP and the master have no authentication of their own: only this machine by
    default; HOST opens them (Kubernetes manifests set it). The public frontend keeps 0.0.0.0."""
    from backend.config import BackendConfig
    from frontend.config import FrontendConfig
    from master.config import MasterConfig
    assert BackendConfig.from_env({"DEVICE": "cpu"}).host == "127.0.0.1"
    opened = BackendConfig.from_env({"DEVICE": "cpu", "HOST": "0.0.0.0", "CLUSTER_TOKEN": "t" * 16})
    assert opened.host == "0.0.0.0"
    assert MasterConfig.from_env({}).host == "127.0.0.1"
    assert FrontendConfig.from_env({}).host == "0.0.0.0"
