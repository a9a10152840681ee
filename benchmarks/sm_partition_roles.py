"""The two loads of `benchmarks/sm_partition.py`: a decode loop and a prefill loop, each built
from the real engine, each timing every iteration (host wall clock around the launch and a
synchronize, which is what a serving loop that reads its tokens meets).

    DecodeLoop(model_dir, device, batch, context)   CUDA-graph replay of one decode step of
                                                    `batch` sequences at `context` tokens
                                                    (eager on CPU); positions are reset every
                                                    RESET_EVERY steps so the context stays put
    PrefillLoop(model_dir, device, prompt_len)      one `prompt_len`-token prefill per iteration
                                                    (piecewise graphs on CUDA)
    run_for(loop, seconds, stream=None)             iteration times in ms, on `stream` if given
"""

from __future__ import annotations

import contextlib
import time

import torch

RESET_EVERY = 64  # decode steps between position resets (the context grows by one a step)


def _engine_config(model_dir: str, device: str, num_blocks: int, max_len: int, budget: int):
    from splitserve.config.engine_config import EngineConfig

    return EngineConfig(
        model_path=str(model_dir),
        device=device,
        cache={"block_size": 16, "num_blocks": num_blocks},
        scheduler={
            "max_model_len": max_len,
            "max_num_batched_tokens": budget,
            "max_batch_size": 256,
        },
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class DecodeLoop:
    def __init__(self, model_dir: str, device: str, batch: int, context: int) -> None:
        from decode_timing import fake_sequences

        from splitserve.decode_worker.config import DecodeWorkerConfig
        from splitserve.decode_worker.engine import DecodeEngine
        from splitserve.decode_worker.graph_runner import GREEDY

        per_seq = -(-(context + RESET_EVERY + 2) // 16)
        cfg = DecodeWorkerConfig(
            engine=_engine_config(
                model_dir, device, batch * per_seq + 8, context + RESET_EVERY + 16, 512
            ),
            cuda_graph_sizes=(batch,),
            prefill_graph_sizes=(16,),
        )
        self.engine = DecodeEngine(cfg)
        self.device = self.engine.runner.device
        if self.device.type == "cuda":
            self.engine.graphs.capture([batch], cfg.warmup_steps)
        self.seqs = fake_sequences(self.engine, batch, context, RESET_EVERY + 1)
        self.graph = self.engine.graphs._graphs.get((batch, GREEDY))  # None on CPU
        self.batch, self.n = batch, 0
        self._reset()
        for _ in range(3):
            self.step()

    def _reset(self) -> None:
        """Back to `context`: a full prepare of the rows (not timed as a step)."""
        g = self.engine.graphs
        for s in self.seqs:
            s.in_flight = 0
        with torch.inference_mode():
            g.read(g.launch(self.seqs, changed=True))
        for s in self.seqs:
            s.in_flight = 0

    def step(self) -> None:
        self.n += 1
        if self.n % RESET_EVERY == 0:
            self._reset()
        if self.graph is not None:
            self.graph.replay()
        else:  # CPU (smoke) or no graph: the eager step body
            self.engine.graphs._body(self.batch)
        _sync(self.device)


class PrefillLoop:
    def __init__(self, model_dir: str, device: str, prompt_len: int) -> None:
        from splitserve.engine.model_runner import ModelRunner, PrefillChunk
        from splitserve.engine.prefill_graphs import capture_prefill_graphs

        blocks = -(-prompt_len // 16) + 2
        cfg = _engine_config(model_dir, device, blocks + 1, prompt_len + 16, prompt_len)
        self.runner = ModelRunner(cfg)
        self.device = self.runner.device
        if self.device.type == "cuda":
            capture_prefill_graphs(self.runner, [prompt_len], prompt_len)
        vocab = self.runner.model_config.vocab_size
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(10, vocab, (prompt_len,), generator=gen).tolist()
        self.chunks = [PrefillChunk(tokens, 0, list(range(1, blocks + 1)))]
        for _ in range(3):  # kernels compiled, allocator sized
            self.step()

    def step(self) -> None:
        self.runner.prefill(self.chunks)
        _sync(self.device)


def run_for(loop, seconds: float, stream=None) -> list[float]:
    """Runs `loop.step` for `seconds`; each iteration's ms."""
    times: list[float] = []
    ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    with torch.inference_mode(), ctx:
        end = time.perf_counter() + seconds
        while (t0 := time.perf_counter()) < end:
            loop.step()
            times.append((time.perf_counter() - t0) * 1e3)
    return times
