"""What `splitserve bench` sends and when: its config, the prompts, the arrival times.

    BenchConfig.from_args(args)       pydantic, frozen; a bad value is one line naming the flag
    make_prompts(cfg, vocab_size)     random token ids of --input-len, or a JSONL file's prompts
    arrival_offsets(n, rate, ...)     seconds after the start: Poisson (gamma with burstiness)
                                      at --request-rate, all zeros for inf

JSONL: one object a line with "prompt" (text) or "prompt_token_ids" / "token_ids" (ids), and
optionally "output_len" and "sampling" (that request's sampling parameters, vLLM's names:
temperature, top_p, top_k, min_p, seed, repetition_penalty, presence_penalty,
frequency_penalty; a row without it uses --temperature); fewer lines than --num-prompts are
cycled. `--traffic realistic` generates such rows instead (traffic.py).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

SloKey = Literal["ttft", "tpot", "itl", "e2el"]
_SLO_ALIASES = {"e2e": "e2el"}


def parse_slo(text: str) -> dict[str, float]:
    """'ttft:500,tpot:50' -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    out: dict[str, float] = {}
    for part in text.replace(" ", ",").split(","):
        if not part:
            continue
        key, sep, value = part.partition(":")
        key = _SLO_ALIASES.get(key.strip().lower(), key.strip().lower())
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if not sep or key not in SloKey.__args__ or not ms > 0:
            raise argparse.ArgumentTypeError(
                f"--slo wants KEY:MS pairs like ttft:500,tpot:50 with keys "
                f"{', '.join(SloKey.__args__)} and MS > 0, got {part!r}"
            )
        out[key] = ms
    return out


class BenchConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    address: str = Field(min_length=1, description="router host:port (grpc) or base URL (openai)")
    backend: Literal["grpc", "openai"] = "grpc"
    num_prompts: int = Field(100, ge=1)
    dataset: str | None = Field(None, description="JSONL file; None: random token ids")
    traffic: Literal["random", "realistic"] = Field(
        "random", description="random: --input-len ids; realistic: traffic.py's mix"
    )
    input_len: int = Field(128, ge=1)
    output_len: int = Field(128, ge=1)
    request_rate: float = Field(math.inf, gt=0, description="requests/s; inf sends all at once")
    burstiness: float = Field(1.0, gt=0, description="gamma shape of the gaps; 1 is Poisson")
    max_concurrency: int | None = Field(None, ge=1)
    ignore_eos: bool = True
    temperature: float = Field(0.0, ge=0)
    seed: int = Field(0, ge=0)
    num_warmups: int = Field(1, ge=0)
    timeout_s: float = Field(600.0, gt=0, description="deadline of each request")
    save_outputs: bool = Field(False, description="keep each request's output token ids")
    traffic_out: str | None = Field(None, description="write the requests sent as JSONL")
    slo: dict[SloKey, float] = Field(
        default_factory=dict, description="milliseconds per metric, for goodput"
    )

    @field_validator("dataset")
    @classmethod
    def _exists(cls, v: str | None) -> str | None:
        if v is not None and not Path(v).is_file():
            raise ValueError(
                'no such file; give a JSONL file with a "prompt" or "prompt_token_ids" per line'
            )
        return v

    @model_validator(mode="after")
    def _one_source(self) -> BenchConfig:
        if self.dataset is not None and self.traffic == "realistic":
            raise ValueError("give --dataset or --traffic realistic, not both")
        return self

    @classmethod
    def from_args(cls, args: argparse.Namespace, address: str) -> BenchConfig:
        values = {
            "address": address,
            "backend": getattr(args, "backend", "grpc"),
            "num_prompts": args.num_prompts,
            "dataset": args.dataset,
            "traffic": getattr(args, "traffic", None) or "random",
            "input_len": args.input_len,
            "output_len": args.output_len,
            "request_rate": args.request_rate,
            "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency,
            "ignore_eos": not args.no_ignore_eos,
            "temperature": args.temperature,
            "seed": args.seed,
            "num_warmups": args.num_warmups,
            "timeout_s": args.timeout,
            "slo": args.slo or {},
            "save_outputs": getattr(args, "save_outputs", False),
            "traffic_out": getattr(args, "traffic_out", None),
        }
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            err = exc.errors()[0]
            if not err["loc"]:  # a rule across fields: its message names the flags
                raise ValueError(err["msg"].removeprefix("Value error, ")) from None
            flag = "--" + "-".join(str(p) for p in err["loc"]).replace("_", "-")
            flag = {"--timeout-s": "--timeout", "--ignore-eos": "--no-ignore-eos"}.get(flag, flag)
            raise ValueError(
                f"{flag} {err['input']!r}: {err['msg'].removeprefix('Value error, ')}"
            ) from None


# the per-request sampling fields a dataset row (or the realistic traffic) may set
SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


@dataclass(frozen=True)
class BenchPrompt:
    prompt: str | tuple[int, ...]
    output_len: int
    sampling: dict | None = None  # this request's sampling fields; None: the run's --temperature
    kind: str = ""  # what the traffic generator made it ("chat/sampled", ...)

    @property
    def known_input_len(self) -> int | None:
        return None if isinstance(self.prompt, str) else len(self.prompt)


def _file_prompts(path: str, n: int, output_len: int) -> list[BenchPrompt]:
    rows: list[BenchPrompt] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                ids = obj.get("prompt_token_ids", obj.get("token_ids"))
                prompt = tuple(int(t) for t in ids) if ids is not None else obj["prompt"]
                if not isinstance(prompt, (str, tuple)) or not prompt:
                    raise ValueError("empty prompt")
                out = int(obj.get("output_len", output_len))
                rows.append(BenchPrompt(prompt, out, check_sampling(obj.get("sampling"), out)))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ValueError(
                    f'{path}:{lineno}: expected an object with a non-empty "prompt" string or '
                    f'"prompt_token_ids" list ({type(exc).__name__}: {exc})'
                ) from None
    if not rows:
        raise ValueError(f"{path}: no prompts in the file")
    return [rows[i % len(rows)] for i in range(n)]


def check_sampling(fields: object, output_len: int) -> dict | None:
    """A row's "sampling" object, checked as the router would (SamplingParams): ValueError
    naming the field otherwise."""
    if fields is None:
        return None
    if not isinstance(fields, dict):
        raise ValueError('"sampling" must be an object like {"temperature": 0.7, "top_p": 0.95}')
    unknown = sorted(set(fields) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(
            f'"sampling" has unknown keys {unknown}; allowed: {", ".join(SAMPLING_KEYS)}'
        )
    from splitserve.request.sampling_params import SamplingParams

    try:
        SamplingParams(max_tokens=output_len, **fields)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise ValueError(f"sampling.{where}: {err['msg']}") from None
    return dict(fields)


def make_prompts(cfg: BenchConfig, vocab_size: int) -> list[BenchPrompt]:
    """--dataset's rows or random ids (--traffic realistic: traffic.realistic_prompts)."""
    if cfg.dataset is not None:
        return _file_prompts(cfg.dataset, cfg.num_prompts, cfg.output_len)
    rng = np.random.default_rng(cfg.seed)
    ids = rng.integers(0, vocab_size, size=(cfg.num_prompts, cfg.input_len))
    return [BenchPrompt(tuple(int(t) for t in row), cfg.output_len) for row in ids]


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Send times in seconds from the start: gamma-distributed gaps with mean 1/rate (shape
    `burstiness`; 1 is a Poisson process), the first request at 0; all zeros for rate inf."""
    if math.isinf(rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed + 1).gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def write_jsonl(path: str | Path, prompts: list[BenchPrompt]) -> None:
    """The requests as the JSONL --dataset reads (ids, output_len, sampling), for replay."""
    with open(path, "w") as f:
        for p in prompts:
            row: dict = {"output_len": p.output_len}
            if isinstance(p.prompt, str):
                row["prompt"] = p.prompt
            else:
                row["prompt_token_ids"] = list(p.prompt)
            if p.sampling is not None:
                row["sampling"] = p.sampling
            f.write(json.dumps(row) + "\n")
