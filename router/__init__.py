"""The router: the public GenerateService in front of prefill and decode workers.

    server.py        the process: grpc.aio server, health, reflection, metrics, drain
    servicer.py      GenerateService (Generate / Abort / GetServerInfo) and RouterControl
    frontend.py      the one request path (validate, run, count) that gRPC and HTTP both call
    http_server.py   the OpenAI-compatible HTTP API (aiohttp): /v1/completions, /v1/chat/completions,
                     /v1/models, /health, /metrics; openai_protocol.py (requests -> GenerateRequest,
                     errors), openai_response.py (chunks -> OpenAI bodies), chat_template.py (jinja2)
    intake.py        request validation and tokenization, before any worker is touched
    generation.py    one request: prefill (one retry), first chunk, decode stream, cleanup
    output.py        token ids -> text deltas, stop strings, finish reason, usage
    registry.py      workers (static + registered), health / GetLoad probes, eviction
    policies.py      round robin, least loaded, prefix-aware (pure functions)
    registration.py  RegisterWorker + Heartbeat client loop (a worker's sidecar)
    config.py, metrics.py, context.py

It reaches workers only over gRPC and imports no worker package.
"""
