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
import copy
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
from bench_vocab import llama3_tokenizer, synthetic_tokenizer, token_bytes  # noqa: E402

ENGINES = {  # module -> the pip requirement measured
    "llguidance": "llguidance==1.9.1",
    "xgrammar": "xgrammar==0.2.8",
    "outlines_core": "outlines-core==0.2.14",
}

MID_SCHEMA = {  # mid-size: nested objects, arrays, enums, bounds, formats a form-filling app sends
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "name": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 8},
        "status": {"enum": ["active", "inactive", "banned", "pending"]},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string", "maxLength": 30},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"enum": ["US", "DE", "FR", "JP", "BR"]},
            },
            "required": ["street", "city", "country"],
            "additionalProperties": False,
        },
        "orders": {
            "type": "array",
            "maxItems": 5,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 16},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                    "price": {"type": "number", "minimum": 0},
                    "gift": {"type": "boolean"},
                },
                "required": ["sku", "qty", "price"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["id", "name", "email", "status", "address", "orders"],
    "additionalProperties": False,
}


def mid_schemas(n: int) -> list[dict]:
    """`MID_SCHEMA` and n-1 variants with every property renamed (`_1`, `_2`, ...) and the
    bounds shifted: the same shape, a different grammar text, so no compile cache hits."""

    def rename(node: object, i: int) -> object:
        if isinstance(node, dict):
            out = {}
            for k, v in node.items():
                if k == "properties":
                    out[k] = {f"{p}_{i}": rename(s, i) for p, s in v.items()}
                elif k == "required":
                    out[k] = [f"{p}_{i}" for p in v]
                elif k in ("maxLength", "maxItems") and isinstance(v, int):
                    out[k] = v + i
                else:
                    out[k] = rename(v, i)
            return out
        if isinstance(node, list):
            return [rename(x, i) for x in node]
        return node

    return [copy.deepcopy(MID_SCHEMA)] + [rename(MID_SCHEMA, i) for i in range(1, n)]


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": required or list(props)}


# (feature, schema, valid instances, invalid instances: each breaks only that feature)
FEATURES = [
    (
        "nested objects",
        _obj({"a": _obj({"b": {"type": "integer"}, "c": _obj({"d": {"type": "boolean"}})})}),
        [{"a": {"b": 1, "c": {"d": True}}}],
        [{"a": {"b": "x", "c": {"d": True}}}, {"a": {"b": 1, "c": {}}}],
    ),
    (
        "array minItems/maxItems",
        {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
        [[1, 2], [1, 2, 3]],
        [[1], [1, 2, 3, 4]],
    ),
    ("enum", {"enum": ["red", "green", 3]}, ["green", 3], ["blue", 4]),
    (
        "number minimum/maximum",
        _obj(
            {
                "i": {"type": "integer", "minimum": 10, "maximum": 20},
                "x": {"type": "number", "minimum": -1.5, "maximum": 2.5},
            }
        ),
        [{"i": 15, "x": 1.25}, {"i": 10, "x": -1.5}],
        [{"i": 21, "x": 0}, {"i": 9, "x": 0}, {"i": 15, "x": 3}, {"i": 15, "x": -2}],
    ),
    (
        "string pattern",
        {"type": "string", "pattern": "^[a-z]{3}-[0-9]{2}$"},
        ["abc-12"],
        ["abc-1x", "ab-12"],
    ),
    (
        "string minLength/maxLength",
        {"type": "string", "minLength": 2, "maxLength": 4},
        ["ab", "abcd"],
        ["a", "abcde"],
    ),
    (
        "anyOf",
        {"anyOf": [{"type": "integer"}, _obj({"k": {"type": "string"}})]},
        [5, {"k": "v"}],
        ["s", True, {"j": "v"}],
    ),
    (
        "$ref/$defs",
        {
            "$defs": {"pt": _obj({"x": {"type": "integer"}})},
            "type": "array",
            "items": {"$ref": "#/$defs/pt"},
            "maxItems": 3,
        },
        [[{"x": 1}, {"x": 2}]],
        [[{"y": 1}], [1]],
    ),
    (
        "additionalProperties false",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "additionalProperties": False,
        },
        [{"a": 1}, {}],
        [{"a": 1, "b": 2}, {"b": 2}],
    ),
    ("const", _obj({"v": {"const": "fixed"}}), [{"v": "fixed"}], [{"v": "other"}]),
    (
        "format date-time",
        {"type": "string", "format": "date-time"},
        ["2024-01-02T03:04:05Z", "2024-01-02T03:04:05.5+02:00"],
        ["not a date", "2024-13-02T03:04:05Z"],
    ),
]


# -- the engines, behind one interface -----------------------------------------------------------


class Llguidance:
    """Compact JSON as splitserve compiles it (request/constraint.py)."""

    def __init__(self, tokenizer_json: Path, vocab: int, eos: int) -> None:
        import llguidance

        self.ll = llguidance
        self.tok = llguidance.LLTokenizer(tokenizer_json.read_text(), n_vocab=vocab, eos_token=eos)
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(
            schema, overrides={"whitespace_flexible": False}
        )
        m = self.ll.LLMatcher(self.tok, grammar)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, matchers, out) -> None:
        from llguidance.numpy import fill_next_token_bitmask_par

        fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], out)

    def advance(self, pairs) -> None:
        ok = self.executor.consume_token_par(pairs)
        assert all(ok), [m.get_error() for m, _ in pairs if m.is_error()]

    def reset(self, m) -> None:
        m.reset()


class Xgrammar:
    def __init__(self, tokenizer_json: Path, vocab: int, eos: int) -> None:
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgrammar
        hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(info)
        self.batch = xgrammar.BatchGrammarMatcher()

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":"), strict_mode=True
        )

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers, out) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, out)

    def advance(self, pairs) -> None:
        ok = self.xgr.BatchGrammarMatcher.batch_accept_token(
            [m for m, _ in pairs], [t for _, t in pairs]
        )
        assert all(ok)

    def reset(self, m) -> None:
        m.reset()


class OutlinesCore:
    """JSON Schema -> regex -> token index over the whole vocabulary (built at compile)."""

    def __init__(self, tokenizer_json: Path, vocab: int, eos: int) -> None:
        import outlines_core

        self.oc = outlines_core
        pieces, special = token_bytes(tokenizer_json)
        by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(pieces[:vocab]):
            if i not in special:  # special tokens are never text
                by_bytes.setdefault(b, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos, by_bytes)

    def compile(self, schema: dict):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema), "")
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def fill(self, matchers, out) -> None:
        words = out.shape[1]
        for i, g in enumerate(matchers):
            g.write_mask_into(out[i].ctypes.data, words, 4)

    def advance(self, pairs) -> None:
        for g, t in pairs:
            g.advance(t, return_tokens=False)

    def reset(self, m) -> None:
        m.reset()


ADAPTERS = {"llguidance": Llguidance, "xgrammar": Xgrammar, "outlines_core": OutlinesCore}


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


# -- install weight ---------------------------------------------------------------------------------


def _dist_sizes(site: Path) -> dict[str, int]:
    """Bytes on disk per installed distribution (its RECORD's files, as they are now)."""
    sizes = {}
    for info in site.glob("*.dist-info"):
        name, total = info.name.split("-")[0], 0
        record = info / "RECORD"
        if record.is_file():
            for line in record.read_text().splitlines():
                path = site / line.split(",")[0]
                if path.is_file():
                    total += path.stat().st_size
        sizes[name] = total
    return sizes


def _tree_bytes(root: Path) -> int:
    return sum(p.lstat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def install_weight(requirement: str, workdir: Path) -> dict:
    venv = workdir / requirement.split("==")[0]
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "install", "--upgrade", "pip"], check=True, capture_output=True)
    site = Path(
        subprocess.check_output(
            [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
        )
        .decode()
        .strip()
    )
    before_dists, before = set(_dist_sizes(site)), _tree_bytes(venv)
    t0 = time.perf_counter()
    done = subprocess.run([*pip, "install", requirement], capture_output=True, text=True)
    if done.returncode:
        return {"error": done.stderr.strip().splitlines()[-1]}
    sizes = _dist_sizes(site)
    added = {k: v for k, v in sizes.items() if k not in before_dists}
    largest = sorted(added.items(), key=lambda kv: -kv[1])[:8]
    mb = round((_tree_bytes(venv) - before) / 2**20, 1)
    shutil.rmtree(venv, ignore_errors=True)
    return {
        "added_mb": mb,
        "distributions": len(added),
        "largest_mb": {k: round(v / 2**20, 1) for k, v in largest},
        "install_s": round(time.perf_counter() - t0, 1),
    }


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
