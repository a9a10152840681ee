"""`splitserve serve` start-and-stop paths: `--prompt` answers once and exits 0, disaggregated
and --colocated (one decode worker that computes its prompts, no prefill worker); a bad
--model and a child that cannot start each end with one line."""

from __future__ import annotations

import argparse
import re

import pytest
from serve_helpers import ENGINE_FLAGS, make_oracle, pid_alive, run_cli


def _started_pids(stderr: str) -> list[int]:
    return [int(p) for p in re.findall(r"started \S+ on \S+ \(pid (\d+)", stderr)]


def test_serve_prompt_answers_and_exits(tiny_llama, tmp_path):
    res = run_cli(
        "serve",
        "--model",
        str(tiny_llama),
        "--port",
        "0",
        *ENGINE_FLAGS,
        "--log-dir",
        str(tmp_path),
        "--prompt",
        "Hello, splitserve",
        "--max-tokens",
        "10",
        timeout=240,
    )
    assert res.returncode == 0, res.stderr
    want = make_oracle(tiny_llama)("Hello, splitserve", 10)
    assert res.stdout == want.text + "\n"
    assert "finish_reason=length" in res.stderr
    pids = _started_pids(res.stderr)
    assert len(pids) == 3 and not [p for p in pids if pid_alive(p)]


def test_bad_model_is_one_line(tmp_path):
    res = run_cli("serve", "--model", str(tmp_path / "missing"), "--port", "0", timeout=60)
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "--model" in lines[0] and "no such folder" in lines[0], res.stderr
    (tmp_path / "empty").mkdir()
    res = run_cli("serve", "--model", str(tmp_path / "empty"), "--port", "0", timeout=60)
    assert res.returncode != 0 and len(res.stderr.strip().splitlines()) == 1
    assert "config.json" in res.stderr


def test_child_failing_to_start_is_one_line_with_its_log(tiny_llama, tmp_path):
    flags = [
        f if f != "4" else "3" for f in ENGINE_FLAGS
    ]  # --block-size 3: refused by the workers' config
    res = run_cli(
        "serve",
        "--model",
        str(tiny_llama),
        "--port",
        "0",
        *flags,
        "--log-dir",
        str(tmp_path),
        timeout=240,
    )
    assert res.returncode == 1
    errors = [ln for ln in res.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1, res.stderr
    assert re.search(
        r"(prefill|decode)-0 exited before it was healthy \(exit code \d+\)", errors[0]
    ), errors[0]
    assert "power of two" in errors[0] and str(tmp_path) in errors[0]
    assert not [p for p in _started_pids(res.stderr) if pid_alive(p)]


def test_colocated(tiny_llama, tmp_path):
    res = run_cli(
        "serve",
        "--colocated",
        "--model",
        str(tiny_llama),
        "--port",
        "0",
        *ENGINE_FLAGS,
        "--log-dir",
        str(tmp_path),
        "--prompt",
        "Hello, splitserve",
        "--max-tokens",
        "10",
        timeout=240,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout == make_oracle(tiny_llama)("Hello, splitserve", 10).text + "\n"
    assert "finish_reason=length" in res.stderr and "colocated + 1 decode worker(s)" in res.stderr
    pids = _started_pids(res.stderr)
    assert len(pids) == 2 and not [
        p for p in pids if pid_alive(p)
    ]  # one decode worker + the router
    assert "colocated (no prefill workers)" in (tmp_path / "router.log").read_text()


def test_colocated_refuses_prefill_workers():
    from splitserve.cli.serve_args import add_arguments, check_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(ValueError, match="--colocated runs no prefill workers"):
        check_args(p.parse_args(["--colocated", "--num-prefill", "1", "--port", "0"]))
    with pytest.raises(ValueError, match="--num-decode must be >= 1"):
        check_args(p.parse_args(["--num-decode", "0", "--port", "0"]))


def test_a_port_just_freed_is_usable_and_a_listened_one_is_refused():
    """Right after a serve exits its port holds connections in TIME_WAIT, which gRPC's and the
    HTTP server's sockets (SO_REUSEADDR) bind over: the start-up check must not refuse it; a port
    some server listens on it refuses, naming the flag to change."""
    import socket

    from splitserve.cli.serve_args import add_arguments, check_args, check_http_port

    p = argparse.ArgumentParser()
    add_arguments(p)
    with socket.socket() as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = srv.accept()
        conn.close()  # the server's side closes first: its end of the connection in TIME_WAIT
        client.close()
    check_args(p.parse_args(["--host", "127.0.0.1", "--port", str(port)]))
    assert check_http_port(p.parse_args(["--host", "127.0.0.1", "--http-port", str(port)])) == port
    with socket.socket() as live:
        live.bind(("127.0.0.1", 0))
        live.listen()
        port = live.getsockname()[1]
        with pytest.raises(ValueError, match="for the router .*pass --port 0"):
            check_args(p.parse_args(["--host", "127.0.0.1", "--port", str(port)]))
        with pytest.raises(ValueError, match="for the OpenAI HTTP API .*--http-port 0"):
            check_http_port(p.parse_args(["--host", "127.0.0.1", "--http-port", str(port)]))
