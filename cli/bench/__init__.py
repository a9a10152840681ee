"""`splitserve bench`: a serving benchmark against the router (in the manner of `vllm bench serve`).

workload.py   BenchConfig, prompts (random ids or JSONL), arrival times
runner.py     grpc.aio requests, per-chunk timing
openai_runner.py   --backend openai: streamed /v1/completions over aiohttp, same timing
metrics.py    throughputs, latency percentiles, goodput
ttft_breakdown.py  TTFT and the second token's gap in parts, from the router's per-request timings
report.py     terminal table, JSON file
plot.py       latency CDFs (matplotlib, optional)
"""
