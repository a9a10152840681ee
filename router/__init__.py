"""The router: the public GenerateService in front of prefill and decode workers.

    server.py        the process: grpc.aio server, health, reflection, metrics, drain
    servicer.py      GenerateService (Generate / Abort / GetServerInfo) and RouterControl
    intake.py        request validation and tokenization, before any worker is touched
    generation.py    one request: prefill (one retry), first chunk, decode stream, cleanup
    output.py        token ids -> text deltas, stop strings, finish reason, usage
    registry.py      workers (static + registered), health / GetLoad probes, eviction
    policies.py      round robin, least loaded, prefix-aware (pure functions)
    registration.py  RegisterWorker + Heartbeat client loop (a worker's sidecar)
    config.py, metrics.py, context.py

It reaches workers only over gRPC and imports no worker package.
"""
