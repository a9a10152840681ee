"""A stop that hangs ends the process with status 3 and a log of every thread's stack, instead of
hanging (service/service_process.py): a real GrpcServer is drained (which arms the deadline), then
the "rest of the stop" blocks forever; the process must exit 3 shortly after stop_timeout_s."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import asyncio, logging, threading
    from splitserve.service.grpc_service import GrpcServer, ServerConfig
    from splitserve.service.service_process import end_cli, run_service_process

    logging.basicConfig(level=logging.INFO)

    async def main():
        server = GrpcServer(ServerConfig(stop_timeout_s=1.0, drain_grace_s=0.0))
        await server.start()
        await server.drain()
        await asyncio.to_thread(threading.Event().wait)  # a stop that never ends
        return 0

    end_cli(run_service_process(main))
    """
)


def test_stuck_stop_exits_3_with_the_stacks():
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert run.returncode == 3, run.stderr
    assert "did not stop in time" in run.stderr and "exiting with status 3" in run.stderr
    assert "Thread 0x" in run.stderr  # faulthandler's dump of every thread


def test_a_clean_stop_exits_with_the_service_code():
    clean = SCRIPT.replace(
        "await asyncio.to_thread(threading.Event().wait)  # a stop that never ends", ""
    )
    run = subprocess.run([sys.executable, "-c", clean], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "did not stop" not in run.stderr
