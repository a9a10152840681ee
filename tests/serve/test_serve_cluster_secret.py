"""`serve` beyond loopback makes a cluster secret for its workers (they refuse to start beyond
loopback without one), and keeps the one the user set, by value or by file."""

from __future__ import annotations

import os

import pytest

from splitserve.cli.serve_args import _cluster_secret_for_children
from splitserve.service.credentials import CLUSTER_SECRET_ENV, CLUSTER_SECRET_FILE_ENV


@pytest.fixture
def clean_env(monkeypatch):
    """Both variables absent, and restored afterwards even when the code under test sets one
    behind monkeypatch's back (set first, so that monkeypatch records their original state: a
    secret leaking into the rest of the session made every later worker demand it)."""
    for name in (CLUSTER_SECRET_ENV, CLUSTER_SECRET_FILE_ENV):
        monkeypatch.setenv(name, "recorded")
        monkeypatch.delenv(name)
    return monkeypatch


def test_beyond_loopback_a_fresh_secret_per_run(clean_env):
    _cluster_secret_for_children("0.0.0.0")
    first = os.environ[CLUSTER_SECRET_ENV]
    clean_env.delenv(CLUSTER_SECRET_ENV)
    _cluster_secret_for_children("::")
    assert len(first) >= 32 and os.environ[CLUSTER_SECRET_ENV] != first


def test_loopback_needs_none(clean_env):
    for host in ("127.0.0.1", "localhost", "::1"):
        _cluster_secret_for_children(host)
        assert CLUSTER_SECRET_ENV not in os.environ


def test_the_users_secret_is_kept(clean_env, tmp_path):
    clean_env.setenv(CLUSTER_SECRET_ENV, "mine-" + "x" * 30)
    _cluster_secret_for_children("0.0.0.0")
    assert os.environ[CLUSTER_SECRET_ENV] == "mine-" + "x" * 30
    clean_env.delenv(CLUSTER_SECRET_ENV)
    clean_env.setenv(CLUSTER_SECRET_FILE_ENV, str(tmp_path / "secret"))
    _cluster_secret_for_children("0.0.0.0")  # the workers read the file: nothing set over it
    assert CLUSTER_SECRET_ENV not in os.environ
