"""/metrics behind the gRPC bearer token (server.auth_token_file); no Ray."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.metrics import ServiceMetrics, serve_metrics

TOKEN = "s3cret"


def get(port: int, authorization: str | None = None) -> tuple[int, dict[str, str], str]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if authorization is not None:
        req.add_header("Authorization", authorization)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, dict(e.headers), e.read().decode()


@pytest.fixture(scope="module")
def guarded_port() -> int:
    return serve_metrics(ServiceMetrics(), 0, token=TOKEN)


def test_no_token_is_401_with_www_authenticate(guarded_port):
    status, headers, body = get(guarded_port)
    assert status == 401
    assert headers["WWW-Authenticate"] == "Bearer"
    assert "Authorization: Bearer" in body and TOKEN not in body


@pytest.mark.parametrize("auth", ["Bearer wrong", f"Basic {TOKEN}", TOKEN, f"Bearer {TOKEN}x",
                                  "Bearer "])
def test_wrong_token_is_401(guarded_port, auth):
    status, headers, _ = get(guarded_port, auth)
    assert status == 401
    assert headers["WWW-Authenticate"] == "Bearer"


def test_right_token_serves_the_registry(guarded_port):
    status, headers, body = get(guarded_port, f"Bearer {TOKEN}")
    assert status == 200
    assert headers["Content-Type"].startswith("text/plain")
    families = {f.name for f in text_string_to_metric_families(body)}
    assert families
    assert "pdserve:time_to_first_token_seconds" in families


def test_without_a_token_the_endpoint_is_open():
    port = serve_metrics(ServiceMetrics(), 0)
    status, headers, body = get(port)
    assert status == 200 and "WWW-Authenticate" not in headers
    assert list(text_string_to_metric_families(body))


def test_empty_token_is_refused():
    with pytest.raises(ValueError):
        serve_metrics(ServiceMetrics(), 0, token="")
