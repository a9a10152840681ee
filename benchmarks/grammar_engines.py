"""The grammar engines compared on the CPU, for the choice in docs/structured_output.md:
llguidance (what splitserve uses), xgrammar and outlines-core, on one tokenizer, with compact
JSON (no free whitespace: what splitserve enforces) in each.

- compile: after one small warm-up schema (some engines build per-tokenizer tables at their
  first compile: reported apart), a cold compile of several mid-size JSON schemas (`MID_SCHEMA` and renamed variants,
  so no engine's cache hits), alone and up to the first mask (llguidance builds its lexer
  lazily, so its first mask pays for part of what the others do at compile), and a new matcher
  from an already compiled schema (what a cache hands each request);
- per step, batch 64: 64 matchers of `MID_SCHEMA` each advanced by a random allowed token
  (each engine's batch API: llguidance `consume_token_par` + `fill_next_token_bitmask_par`,
  xgrammar `BatchGrammarMatcher`, outlines-core per row: it has no batch call), p50 / p90 /
  max of advance + fill; a row whose output is complete starts over (outside the timing);
- JSON Schema features (`FEATURES`): each compiled alone, then valid and invalid instances fed
  token by token against the engine's own mask: "supported" (valid ones pass, invalid ones
  are cut), "ignored" (compiles, but an invalid instance passes), "refused" (the compile
  fails; the engine's message is kept), "wrong" (a valid instance is cut);
- `--install-weight`: MB that `pip install <package>` adds to a fresh venv under the temp dir,
  with its dependencies (installed size on disk, the largest distributions named).

Each engine's work runs in a child process with a time limit; an engine that does not import
is skipped and said so. Needs only numpy, `tokenizers` and the engines (no splitserve, no
torch), so it runs in a throw-away venv:

    python3 -m venv /tmp/ge && /tmp/ge/bin/pip install llguidance==1.9.1 xgrammar==0.2.8 \
        outlines-core==0.2.14
    /tmp/ge/bin/python benchmarks/grammar_engines.py --llama3 /tmp/w/llama_models/llama3/tokenizer.model \
        --install-weight --out benchmarks/results/cpu-2026-12-04/grammar_engines.json

`--llama3`: Llama 3's tiktoken file (benchmarks/bench_vocab.py says where to get it: the
128,256-token vocabulary of a real model); `--tokenizer DIR` takes any tokenizer.json; without
either, a synthetic byte-level vocabulary of `--synthetic-vocab` tokens (default 128,000).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_vocab, also when imported
from bench_vocab import llama3_tokenizer, synthetic_tokenizer  # noqa: E402
from grammar_engine_adapters import ADAPTERS  # noqa: E402
from grammar_engine_cases import ENGINES, FEATURES, MID_SCHEMA, mid_schemas  # noqa: E402
from grammar_engine_install import install_weight  # noqa: E402

# -- the child process: one engine, one task ------------------------------------------------------


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1e3, 3)


def _emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def _allowed(row, vocab: int):
    import numpy as np

    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab])


def child(args: argparse.Namespace) -> None:
    import numpy as np

    engine, task = args.child.split(":")
    folder = Path(args.tokenizer_dir)
    t0 = time.perf_counter()
    eng = ADAPTERS[engine](folder / "tokenizer.json", args.vocab, args.eos)
    _emit({"setup_ms": _ms(t0)})
    words = (args.vocab + 31) // 32
    if task == "compile":
        t0 = time.perf_counter()  # one-time work per tokenizer some engines do at a first compile
        eng.fill(
            [eng.matcher(eng.compile({"type": "array", "items": {"type": "integer"}}))],
            np.zeros((1, words), dtype=np.int32),
        )
        _emit({"warm_up_compile_ms": _ms(t0)})
        for i, schema in enumerate(mid_schemas(args.schemas)):
            t0 = time.perf_counter()
            compiled = eng.compile(schema)
            compile_ms = _ms(t0)
            m = eng.matcher(compiled)
            mask = np.zeros((1, words), dtype=np.int32)
            eng.fill([m], mask)
            first_ms = _ms(t0)
            t0 = time.perf_counter()
            for _ in range(10):
                eng.matcher(compiled)
            _emit(
                {
                    "schema": i,
                    "compile_ms": compile_ms,
                    "compile_to_first_mask_ms": first_ms,
                    "new_matcher_ms": round(_ms(t0) / 10, 4),
                    "allowed_first": len(_allowed(mask[0], args.vocab)),
                }
            )
    elif task == "steps":
        compiled = eng.compile(MID_SCHEMA)
        matchers = [eng.matcher(compiled) for _ in range(args.batch)]
        masks = np.zeros((args.batch, words), dtype=np.int32)
        rng = np.random.default_rng(0)
        pending: list = []  # (matcher, token) to advance at the next step
        advance_ms, fill_ms, restarts = [], [], 0
        for _ in range(args.steps + 1):
            t0 = time.perf_counter()
            if pending:
                eng.advance(pending)
            t1 = time.perf_counter()
            eng.fill(matchers, masks)
            t2 = time.perf_counter()
            advance_ms.append((t1 - t0) * 1e3)
            fill_ms.append((t2 - t1) * 1e3)
            pending = []
            for m, row in zip(matchers, masks):
                allowed = _allowed(row, args.vocab)
                allowed = allowed[allowed != args.eos]
                if len(allowed) == 0:  # complete (only EOS): start over
                    eng.reset(m)
                    restarts += 1
                else:
                    pending.append((m, int(rng.choice(allowed))))
        total = [a + f for a, f in zip(advance_ms, fill_ms)]

        def stats(xs: list[float]) -> dict:
            return {
                "p50": round(statistics.median(xs), 3),
                "p90": round(statistics.quantiles(xs, n=10, method="inclusive")[-1], 3),
                "max": round(max(xs), 3),
            }

        _emit(
            {
                "batch": args.batch,
                "steps": args.steps,
                "first_step_ms": round(total[0], 3),  # fill only: nothing to advance yet
                "step_ms": stats(total[1:]),
                "advance_ms": stats(advance_ms[1:]),
                "fill_ms": stats(fill_ms[1:]),
                "rows_completed": restarts,
            }
        )
    elif task == "features":
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        for name, schema, valid, invalid in FEATURES:
            t0 = time.perf_counter()
            try:
                compiled = eng.compile(schema)
            except Exception as exc:  # the engine's refusal, whatever its type
                _emit({"feature": name, "verdict": "refused", "message": str(exc)[:300]})
                continue
            compile_ms = _ms(t0)

            def passes(value: object) -> bool:
                text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
                m = eng.matcher(compiled)
                mask = np.zeros((1, words), dtype=np.int32)
                for t in tok.encode(text, add_special_tokens=False).ids:
                    eng.fill([m], mask)
                    if not (mask[0, t // 32] >> (t % 32)) & 1:
                        return False
                    eng.advance([(m, t)])
                eng.fill([m], mask)
                return bool((mask[0, args.eos // 32] >> (args.eos % 32)) & 1)

            cut_valid = [v for v in valid if not passes(v)]
            passed_invalid = [v for v in invalid if passes(v)]
            verdict = "wrong" if cut_valid else "ignored" if passed_invalid else "supported"
            _emit(
                {
                    "feature": name,
                    "verdict": verdict,
                    "compile_ms": compile_ms,
                    "valid_cut": cut_valid,
                    "invalid_passed": passed_invalid,
                }
            )
    _emit({"peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)})


def run_child(engine: str, task: str, args, folder: Path, vocab: int, eos: int) -> dict:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        f"{engine}:{task}",
        "--tokenizer-dir",
        str(folder),
        "--vocab",
        str(vocab),
        "--eos",
        str(eos),
        "--batch",
        str(args.batch),
        "--steps",
        str(args.steps),
        "--schemas",
        str(args.schemas),
    ]
    print(f"{engine}: {task} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s)
        out, err, timed_out = done.stdout, done.stderr, False
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        err, timed_out = "", True
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    result: dict = {"wall_s": round(time.perf_counter() - t0, 1)}
    for line in lines:
        if "schema" in line:
            result.setdefault("schemas", []).append(line)
        elif "feature" in line:
            result.setdefault("features", {})[line.pop("feature")] = line
        else:
            result.update(line)
    if timed_out:
        result["error"] = f"timed out after {args.timeout_s} s (results above are what finished)"
    elif done.returncode != 0:
        result["error"] = err.strip().splitlines()[-1] if err.strip() else f"exit {done.returncode}"
    return result


def importable(module: str) -> tuple[bool, str]:
    probe = (
        f"import {module}, importlib.metadata as m; print(m.version({module!r}.replace('_', '-')))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if done.returncode:
        return False, (done.stderr.strip().splitlines() or ["?"])[-1]
    return True, done.stdout.strip()


# -- main ---------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama3", type=Path, help="Llama 3's tiktoken file (tokenizer.model)")
    ap.add_argument("--tokenizer", type=Path, help="a folder with a tokenizer.json")
    ap.add_argument("--eos", type=int, help="with --tokenizer: the EOS id")
    ap.add_argument("--synthetic-vocab", type=int, default=128_000)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--schemas", type=int, default=4, help="cold compiles: MID_SCHEMA + variants")
    ap.add_argument("--timeout-s", type=int, default=900, help="per engine and task")
    ap.add_argument("--install-weight", action="store_true")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--tokenizer-dir", help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    tmp = Path(tempfile.mkdtemp(prefix="grammar_engines_"))
    if args.llama3:
        folder, vocab, eos = llama3_tokenizer(args.llama3, tmp / "tok")
        vocab_name = f"Llama 3 ({args.llama3.name} from llama-models 0.3.0), {vocab} tokens"
    elif args.tokenizer:
        from tokenizers import Tokenizer

        folder = args.tokenizer
        vocab = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size()
        eos, vocab_name = args.eos, f"{folder / 'tokenizer.json'}, {vocab} tokens"
    else:
        folder, vocab, eos = synthetic_tokenizer(args.synthetic_vocab, tmp / "tok")
        vocab_name = f"synthetic byte-level (bench_vocab.synthetic_tokenizer), {vocab} tokens"
    report: dict = {
        "what": "grammar engines on the CPU: compile, mask per step, JSON Schema features, install",
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "machine": {
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "load_average_1m_at_start": round(os.getloadavg()[0], 2),  # a shared machine?
        },
        "vocab": vocab_name,
        "eos": eos,
        "json_whitespace": "none (compact separators) in every engine",
        "engines": {},
    }
    for engine in args.engines.split(","):
        ok, version = importable(engine)
        entry: dict = {"requirement": ENGINES[engine]}
        report["engines"][engine] = entry
        if not ok:
            entry["skipped"] = f"not importable here: {version}"
            print(f"{engine}: skipped ({version})", file=sys.stderr)
            continue
        entry["version"] = version
        for task in ("compile", "steps", "features"):
            entry[task] = run_child(engine, task, args, folder, vocab, eos)
        compiles = entry["compile"].get("schemas", [])
        if compiles:
            entry["compile"]["median_compile_ms"] = statistics.median(
                c["compile_ms"] for c in compiles
            )
            entry["compile"]["median_compile_to_first_mask_ms"] = statistics.median(
                c["compile_to_first_mask_ms"] for c in compiles
            )
        feats = entry["features"].get("features", {})
        entry["features"]["summary"] = {k: v["verdict"] for k, v in feats.items()}
    if args.install_weight:
        for engine, requirement in ENGINES.items():
            print(f"{engine}: install weight ...", file=sys.stderr, flush=True)
            report["engines"][engine]["install"] = install_weight(requirement, tmp)
    report["machine"]["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    shutil.rmtree(tmp, ignore_errors=True)
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
