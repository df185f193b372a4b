"""/metrics behind the gRPC bearer token (server.auth_token_file) and, when gRPC uses
TLS, over HTTPS with the same certificate; no Ray."""

from __future__ import annotations

import http.client
import ssl
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.config.serve import ServerSection
from cluster.metrics import ServiceMetrics, serve_metrics, serve_metrics_for
from tests.tls_cert import self_signed_cert

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


# ---- TLS: the token never travels in the clear when gRPC uses TLS ---------------------
@pytest.fixture(scope="module")
def tls_cert(tmp_path_factory):
    return self_signed_cert(tmp_path_factory.mktemp("tls"))


def get_tls(url: str, cafile, authorization: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url)
    if authorization is not None:
        req.add_header("Authorization", authorization)
    ctx = ssl.create_default_context(cafile=str(cafile))
    try:
        with urllib.request.urlopen(req, timeout=10, context=ctx) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read().decode()


def test_with_tls_configured_metrics_are_served_over_https_only(tls_cert):
    cert, key = tls_cert
    token_file = cert.parent / "token"
    token_file.write_text(TOKEN)
    server = ServerSection(port=0, metrics_port=0, tls_cert=str(cert), tls_key=str(key),
                           auth_token_file=str(token_file))
    url = serve_metrics_for(server, ServiceMetrics())
    assert url.startswith("https://127.0.0.1:")
    status, body = get_tls(url, cert, f"Bearer {TOKEN}")
    assert status == 200 and "pdserve:time_to_first_token_seconds" in body
    assert get_tls(url, cert)[0] == 401
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
        get(port, f"Bearer {TOKEN}")  # plain HTTP: no answer, the token is not accepted
    assert get_tls(url, cert, f"Bearer {TOKEN}")[0] == 200  # still serving


def test_without_tls_the_url_is_http_and_a_token_off_loopback_is_warned_about(tmp_path,
                                                                             caplog):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    url = serve_metrics_for(ServerSection(port=0, metrics_port=0), ServiceMetrics())
    assert url.startswith("http://127.0.0.1:") and get(int(url.split(":")[2].split("/")[0]))[0] \
        == 200
    assert "in the clear" not in caplog.text
    serve_metrics_for(ServerSection(host="0.0.0.0", port=0, metrics_port=0,
                                    auth_token_file=str(token_file)), ServiceMetrics())
    assert "sends its bearer token in the clear" in caplog.text
