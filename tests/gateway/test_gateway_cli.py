"""`kvyard gateway URL...`: its flags are the gateway's variables, and bad input is one line and exit 2."""
from __future__ import annotations

import pytest

from gateway.config import GatewayConfig
from launcher.cli import gateway_env, gateway_parser, main


def test_arguments_become_the_gateways_environment() -> None:
    env = gateway_env(gateway_parser().parse_args(["http://a:1", "http://b:2/v1", "--port", "9000", "--debug",
                                                   "--max-connect-per-upstream", "4", "--wait-for", "30000"]))
    assert env == {"ROLE_TYPE": "GATEWAY", "UPSTREAMS": "http://a:1,http://b:2/v1", "TIB_PORT": "9000",
                   "DEBUG": "true", "MAX_CONNECT_PER_UPSTREAM": "4", "WAIT_FOR": "30000"}
    cfg = GatewayConfig.from_env(env)
    assert cfg.upstreams == ("http://a:1", "http://b:2") and cfg.port == 9000 and cfg.wait_for_s == 30.0


@pytest.mark.parametrize("args,needle", [
    (["gateway", "http://a:1", "--wait-for", "soon"], "--wait-for (WAIT_FOR) must be an integer"),
    (["gateway"], "UPSTREAMS"),
    (["gateway", "http://a:1,http://b:2"], "separated by spaces"),
    (["gateway", "http://a:1", "--routing", "random"], "--routing (GATEWAY_ROUTING) must be one of"),
    (["gateway", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], needle: str, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("UPSTREAMS", "ROLE_TYPE", "TIB_PORT", "START_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvyard: error: ") and needle in lines[0], lines
