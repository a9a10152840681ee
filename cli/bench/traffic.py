"""`splitserve bench --traffic realistic`: a seeded request mix shaped like public LLM traces,
with per-request sampling parameters (what real traffic sends, not one greedy shape).

Shape (log-normal lengths, median m and spread s: p99 = m * exp(2.33 s); clipped to the
server's max_model_len), from published trace statistics:

    chat, 70 %     prompt m 250 s 1.0, output m 220 s 0.8. ShareGPT (vLLM's serving-benchmark
                   set; the vLLM paper, SOSP'23: mean input 161, mean output 338 tokens) and
                   LMSYS-Chat-1M (Zheng et al. 2023: 69.5 prompt / 214.5 response tokens a turn,
                   2.0 turns a conversation on average): short prompts, long answers, long tail
    coding, 30 %   prompt m 1500 s 0.7, output m 20 s 1.0. Azure LLM inference trace 2023
                   (Splitwise, Patel et al., ISCA'24: coding median 1,500 prompt / 13 output
                   tokens; conversation 1,020 / 129): long contexts, short completions
    multi-turn     35 % of chat conversations go on for 2-4 turns; turn k's prompt is turn k-1's
                   prompt + an answer of its output length + a new user message (m 60 s 0.8),
                   so it shares turn k-1's tokens as a prefix (Mooncake/Kimi report about half
                   of prompt tokens reusable from earlier turns); the next turn is queued a few
                   requests later, as a user reads and replies

Sampling (the default mix of issue 33): 70 % temperature 0.7 / top_p 0.95 (what chat clients
send), 20 % greedy, 10 % seeded (a per-request seed) with presence 0.3, frequency 0.3 and
repetition 1.1 penalties. Approximations: token ids are random (no text), turn gaps are request
positions (not seconds), and a row's output length is what the request asks for
(`ignore_eos` keeps it exact).

    realistic_prompts(n, vocab_size, seed, max_len)  -> list[BenchPrompt]
    bench_prompts(cfg, vocab_size, max_model_len)    the run's requests: this mix with
                                                     --traffic realistic, else workload.py's
    describe(prompts)                                -> the mix as sent (for --json-out)
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

from splitserve.cli.bench.workload import BenchPrompt, make_prompts

CHAT_SHARE = 0.7
CHAT = {"prompt": (250, 1.0), "output": (220, 0.8)}
CODING = {"prompt": (1500, 0.7), "output": (20, 1.0)}
FOLLOW_UP = (60, 0.8)  # a later turn's new user message
MULTI_TURN_SHARE = 0.35
MAX_TURNS = 4
TURN_GAP = (2, 12)  # requests between a turn and the next one of its conversation
SAMPLED = {"temperature": 0.7, "top_p": 0.95}
PENALISED = {"temperature": 0.8, "presence_penalty": 0.3, "frequency_penalty": 0.3}
PENALISED_REPETITION = 1.1
CLASS_SHARES = (("sampled", 0.7), ("greedy", 0.2), ("seeded_penalties", 0.1))
MIN_PROMPT, MIN_OUTPUT = 4, 1


def _lognormal(rng: np.random.Generator, median_spread: tuple[float, float]) -> int:
    median, spread = median_spread
    return max(1, int(round(median * math.exp(spread * rng.standard_normal()))))


def _sampling(rng: np.random.Generator) -> tuple[str, dict]:
    names, shares = zip(*CLASS_SHARES)
    name = str(rng.choice(names, p=shares))
    if name == "greedy":
        return name, {"temperature": 0.0}
    if name == "sampled":
        return name, dict(SAMPLED)
    seed = int(rng.integers(0, 2**31))
    return name, {**PENALISED, "repetition_penalty": PENALISED_REPETITION, "seed": seed}


def _fit(prompt_len: int, output_len: int, max_len: int) -> tuple[int, int]:
    """Clips a draw to the server: the output first keeps at least MIN_OUTPUT, the prompt
    takes what is left (a long tail is clipped, not redrawn, so the cap shows in the mix)."""
    output_len = max(MIN_OUTPUT, min(output_len, max_len // 2, max_len - MIN_PROMPT))
    prompt_len = max(MIN_PROMPT, min(prompt_len, max_len - output_len))
    return prompt_len, output_len


def realistic_prompts(n: int, vocab_size: int, seed: int, max_len: int) -> list[BenchPrompt]:
    """`n` requests of the mix above (the same for the same arguments); prompt + output of each
    fit in `max_len` tokens."""
    if max_len < MIN_PROMPT + MIN_OUTPUT:
        raise ValueError(f"max_model_len {max_len} is too short for the realistic traffic")
    rng = np.random.default_rng(seed)
    low = min(10, vocab_size - 1)

    def tokens(k: int) -> list[int]:
        return rng.integers(low, vocab_size, size=k).tolist()

    out: list[BenchPrompt | None] = [None] * n
    pending: list[tuple[int, BenchPrompt]] = []  # (position, follow-up turn) still to place
    i = 0
    while i < n:
        due = next((p for p in pending if p[0] <= i), None)
        if due is not None:
            pending.remove(due)
            out[i] = due[1]
            i += 1
            continue
        chat = rng.random() < CHAT_SHARE
        shape = CHAT if chat else CODING
        p_len, o_len = _fit(
            _lognormal(rng, shape["prompt"]), _lognormal(rng, shape["output"]), max_len
        )
        kind, sampling = _sampling(rng)
        prompt = tokens(p_len)
        out[i] = BenchPrompt(
            tuple(prompt), o_len, sampling, f"{'chat' if chat else 'coding'}/{kind}"
        )
        turns = (
            int(rng.integers(2, MAX_TURNS + 1)) if chat and rng.random() < MULTI_TURN_SHARE else 1
        )
        at = i
        for _ in range(turns - 1):
            history = prompt + tokens(o_len)  # the previous turn's answer joins the context
            new = _lognormal(rng, FOLLOW_UP)
            o_len = _lognormal(rng, CHAT["output"])
            if len(history) + new + o_len > max_len:
                break  # the conversation outgrew the context: it ends here
            prompt = history + tokens(new)
            at += int(rng.integers(*TURN_GAP))
            pending.append((at, BenchPrompt(tuple(prompt), o_len, sampling, f"chat-turn/{kind}")))
        i += 1
    return [p for p in out if p is not None]


def describe(prompts: list[BenchPrompt]) -> dict:
    """The mix as sent: requests per kind and per sampling class, length percentiles."""
    ins = np.array([p.known_input_len or 0 for p in prompts])
    outs = np.array([p.output_len for p in prompts])

    def pct(a: np.ndarray) -> dict[str, float]:
        return {f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)} | {"max": float(a.max())}

    kinds = Counter(p.kind.split("/")[0] for p in prompts)
    classes = Counter(p.kind.split("/")[-1] for p in prompts)
    return {
        "requests": len(prompts),
        "kinds": dict(kinds),
        "sampling": dict(classes),
        "prompt_len": pct(ins),
        "output_len": pct(outs),
    }


def bench_prompts(cfg, vocab_size: int, max_model_len: int = 0) -> list[BenchPrompt]:
    """The run's requests: the realistic mix (capped by the server's max_model_len; 0:
    unknown, 4096) or make_prompts' dataset rows / random ids."""
    if cfg.traffic == "realistic":
        return realistic_prompts(cfg.num_prompts, vocab_size, cfg.seed, max_model_len or 4096)
    return make_prompts(cfg, vocab_size)
