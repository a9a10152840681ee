"""Units of the router's access control: key files, scopes, the cluster check, the limits."""

from __future__ import annotations

import grpc
import pytest
from router_helpers import router_config

from splitserve.request.errors import RequestError
from splitserve.router.auth import Authenticator, fingerprint, grpc_peer_host
from splitserve.router.auth_config import AuthConfig
from splitserve.router.caller_limits import CallerLimits
from splitserve.service.credentials import CredentialError, cluster_secret, load_keys, match_key

KEY_A, KEY_B, ADMIN = "a" * 20 + "1", "b" * 20 + "2", "c" * 20 + "3"


def _auth(tiny_llama, monkeypatch, host="127.0.0.1", **auth) -> Authenticator:
    monkeypatch.delenv("SPLITSERVE_CLUSTER_SECRET", raising=False)
    monkeypatch.delenv("SPLITSERVE_CLUSTER_SECRET_FILE", raising=False)
    return Authenticator(router_config(tiny_llama, server={"host": host}, auth=auth))


def test_keys_from_file_and_env_weak_keys_refused(tmp_path, monkeypatch):
    f = tmp_path / "keys"
    f.write_text(f"# comment\n{KEY_A}  # trailing comment\n\n{KEY_A}\n")
    monkeypatch.setenv("K", f" {KEY_B}, ")
    assert load_keys(str(f), "K") == (KEY_A, KEY_B)
    f.write_text("weakkey9\n")
    with pytest.raises(CredentialError, match="shorter than 16") as weak:
        load_keys(str(f), None)
    assert "weakkey9" not in str(weak.value)
    with pytest.raises(CredentialError, match="cannot read"):
        load_keys(str(tmp_path / "missing"), None)
    assert match_key(KEY_B, (KEY_A, KEY_B)) == KEY_B and match_key("x", (KEY_A,)) is None


def test_cluster_secret_sources(tmp_path, monkeypatch):
    monkeypatch.delenv("SPLITSERVE_CLUSTER_SECRET_FILE", raising=False)
    monkeypatch.delenv("SPLITSERVE_CLUSTER_SECRET", raising=False)
    assert cluster_secret() is None
    monkeypatch.setenv("SPLITSERVE_CLUSTER_SECRET", KEY_A)
    assert cluster_secret() == KEY_A.encode()
    f = tmp_path / "s"
    f.write_text(KEY_B + "\n")
    monkeypatch.setenv("SPLITSERVE_CLUSTER_SECRET_FILE", str(f))
    assert cluster_secret() == KEY_B.encode()  # the file wins over the value
    monkeypatch.setenv("SPLITSERVE_CLUSTER_SECRET", "weak")
    monkeypatch.delenv("SPLITSERVE_CLUSTER_SECRET_FILE")
    with pytest.raises(CredentialError):
        cluster_secret()


def test_scopes_admins_and_refusals(tiny_llama, monkeypatch):
    monkeypatch.setenv("SPLITSERVE_API_KEYS", f"{KEY_A},{KEY_B}")
    monkeypatch.setenv("SPLITSERVE_ADMIN_KEYS", ADMIN)
    auth = _auth(tiny_llama, monkeypatch)
    a = auth.caller(f"Bearer {KEY_A}", "10.0.0.1")
    a_elsewhere = auth.caller(f"Bearer {KEY_A}", "10.0.0.9")
    b = auth.caller(f"Bearer {KEY_B}", "10.0.0.1")
    admin = auth.caller(f"Bearer {ADMIN}", "10.0.0.1")
    assert a.scope == a_elsewhere.scope == f"key:{fingerprint(KEY_A)}" != b.scope
    assert KEY_A not in a.scope and not a.admin and admin.admin
    for header in (None, "Bearer " + "z" * 20, f"Basic {KEY_A}"):
        with pytest.raises(RequestError) as err:
            auth.caller(header, "10.0.0.1")
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(RequestError) as denied:
        auth.admin_only(a, "/metrics")
    assert denied.value.code == grpc.StatusCode.PERMISSION_DENIED


def test_without_keys_the_peer_address_is_the_scope(tiny_llama, monkeypatch):
    monkeypatch.delenv("SPLITSERVE_API_KEYS", raising=False)
    monkeypatch.delenv("SPLITSERVE_ADMIN_KEYS", raising=False)
    auth = _auth(tiny_llama, monkeypatch)
    assert grpc_peer_host("ipv4:10.1.2.3:5555") == "10.1.2.3"
    assert grpc_peer_host("ipv6:[::1]:5555") == "::1"
    one = auth.caller(None, grpc_peer_host("ipv4:10.1.2.3:5555"))
    same = auth.caller(None, grpc_peer_host("ipv4:10.1.2.3:6666"))
    assert one.scope == same.scope == "peer:10.1.2.3" and one.admin  # loopback-only dev mode
    auth.check_cluster(None, on_control_listener=False)  # loopback-only: registration is open
    opened = _auth(tiny_llama, monkeypatch, host="0.0.0.0", require_api_key=False)
    assert not opened.caller(None, "10.1.2.3").admin
    with pytest.raises(RequestError) as refused:
        opened.check_cluster(None, on_control_listener=False)
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    opened.check_cluster(None, on_control_listener=True)


def test_cluster_secret_is_checked_on_any_listener(tiny_llama, monkeypatch):
    auth = _auth(tiny_llama, monkeypatch)
    monkeypatch.setenv("SPLITSERVE_CLUSTER_SECRET", KEY_A)
    auth = Authenticator(router_config(tiny_llama))
    auth.check_cluster(f"Bearer {KEY_A}", on_control_listener=False)
    for private in (False, True):
        with pytest.raises(RequestError):
            auth.check_cluster(f"Bearer {KEY_B}", on_control_listener=private)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_rate_and_concurrency_limits_per_caller():
    clock = _Clock()
    limits = CallerLimits(AuthConfig(rate_per_s=2.0, burst=2, max_concurrent=3), clock)
    first, second = limits.admit("x"), limits.admit("x")
    with pytest.raises(RequestError) as rate:
        limits.admit("x")
    assert rate.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert rate.value.retry_after_s == pytest.approx(0.5)
    limits.admit("y")()  # another caller has its own bucket
    clock.now = 0.5
    third = limits.admit("x")
    clock.now = 10.0
    with pytest.raises(RequestError) as busy:
        limits.admit("x")  # three in flight: the concurrency limit, whatever the bucket holds
    assert "in flight" in busy.value.message and busy.value.retry_after_s
    first()
    first()  # releasing twice counts once
    limits.admit("x")
    second(), third()
    assert not CallerLimits(AuthConfig()).enabled


def test_the_caller_table_is_bounded(monkeypatch):
    """Past MAX_CALLERS, idle callers with full buckets make room; if every caller is busy a
    newcomer is refused rather than the table growing without bound."""
    import splitserve.router.caller_limits as caller_limits

    monkeypatch.setattr(caller_limits, "MAX_CALLERS", 3)
    clock = _Clock()
    limits = CallerLimits(AuthConfig(rate_per_s=1.0, burst=1, max_concurrent=5), clock)
    held = [limits.admit(f"busy{i}") for i in range(3)]
    with pytest.raises(RequestError) as full:
        limits.admit("newcomer")
    assert full.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "too many distinct callers" in full.value.message and full.value.retry_after_s
    held[0]()  # one caller goes idle, and its bucket refills
    clock.now = 5.0
    limits.admit("newcomer")()  # room made by dropping the idle one
    assert len(limits._callers) == 3 and "busy0" not in limits._callers


def test_an_open_control_listener_beyond_loopback_is_warned_about(tiny_llama, monkeypatch, caplog):
    monkeypatch.setenv("SPLITSERVE_API_KEYS", KEY_A)
    caplog.set_level("WARNING", logger="splitserve.router.auth")
    for host, warned in (("127.0.0.1", False), ("0.0.0.0", True)):
        caplog.clear()
        monkeypatch.delenv("SPLITSERVE_CLUSTER_SECRET", raising=False)
        Authenticator(router_config(tiny_llama, control={"host": host, "port": 0}))
        said = [r.getMessage() for r in caplog.records if "control listener" in r.getMessage()]
        assert bool(said) == warned, (host, said)
    monkeypatch.setenv("SPLITSERVE_CLUSTER_SECRET", KEY_B)  # a secret closes it: no warning
    caplog.clear()
    Authenticator(router_config(tiny_llama, control={"host": "0.0.0.0", "port": 0}))
    assert not [r for r in caplog.records if "control listener" in r.getMessage()]
