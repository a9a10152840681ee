"""Small-M (decode) linear cases of `benchmarks/kernels.py`: the fused Triton GEMV kernels
(add + RMSNorm + linear, SiLU-mul + linear, plain GEMV) against the unfused torch path on the
same inputs (Triton norm / activation kernel + cuBLAS F.linear), both timed in CUDA graphs;
and `--sweep-linear`: BLOCK_N x BLOCK_K x num_warps x num_stages variants per shape; the best
of each shape is printed as a ready `TUNED` entry for kernels/triton_fused_linear.py.
"""

from __future__ import annotations

import itertools

# name: (op, K, N) at the Llama-3.2-1B shape (hidden 2048, intermediate 8192, vocab 128256)
LINEAR_SHAPES = {
    "qkv": ("norm", 2048, 3072),
    "gate_up": ("norm", 2048, 16384),
    "down": ("silu", 8192, 2048),
    "o_proj": ("plain", 2048, 2048),
    "lm_head": ("norm", 2048, 128256),
}
SWEEP_BLOCK_N = (2, 4, 8, 16)
SWEEP_K_VECTORS = (
    1,
    2,
)  # BLOCK_K = this many 16-byte vectors per thread and row (1 = the automatic size)
SWEEP_WARPS = (4, 8)
SWEEP_STAGES = (1, 3)
SWEEP_MAX_ACC = 32  # skip BLOCK_M * BLOCK_N above this (register spills)
SWEEP_MAX_W_VECTORS = 16  # skip BLOCK_N * vectors above this (register spills)


def add_linear_cases(add, Case, rnd, torch, tri, ms, el=2) -> dict:
    """Adds one case per shape and M in `ms` through `add`; returns {case name: (op, args)} for
    the sweep (args feed the `*_impl` functions)."""
    F = torch.nn.functional
    inputs = {}
    for m, (name, (op, k, n)) in itertools.product(ms, LINEAR_SHAPES.items()):
        w = rnd(n, k) / k**0.5
        nbytes = n * k * el + m * n * el  # weight + output
        if op == "norm":
            x, r, nw = rnd(m, k), rnd(m, k), rnd(k)
            nbytes += (
                4 * m * k * el
            )  # x, residual in, new residual out: compulsory bytes (re-reads hit L2)
            args = (x, r, nw, 1e-5, w, None)

            def fn(a=args):
                return tri.fused_add_rms_norm_linear(*a)

            def ref(x=x, r=r, nw=nw, w=w):
                normed, summed = tri.fused_add_rms_norm(x, r, nw, 1e-5)
                return F.linear(normed, w), summed

            ref_name = "triton norm+F.linear"
        elif op == "silu":
            gu = rnd(m, 2 * k)
            nbytes += 2 * m * k * el
            args = (gu, w, None)

            def fn(a=args):
                return tri.silu_mul_linear(*a)

            def ref(gu=gu, w=w):
                return F.linear(tri.silu_and_mul(gu), w)

            ref_name = "silu_and_mul+F.linear"
        else:
            x = rnd(m, k)
            nbytes += m * k * el
            args = (x, w, None)

            def fn(a=args):
                return tri.linear_small_m(*a)

            def ref(x=x, w=w):
                return F.linear(x, w)

            ref_name = "F.linear"
        case_name = f"small_m_linear {name} M={m} N={n} K={k}"
        if add(
            Case(
                case_name,
                f"small_m_linear_{op}",
                dict(M=m, N=n, K=k, op=op),
                nbytes,
                flops=2.0 * m * n * k,
            ),
            fn,
            (ref_name, ref, True),
        ):
            inputs[case_name] = (op, args)
    return inputs


def check_linear_cases(cases, torch) -> None:
    """Max abs difference of the fused kernels vs the unfused path, on the benchmark inputs."""
    for case, fn, ref in cases:
        if case.kernel.startswith("small_m_linear"):
            out, exp = fn(), ref[1]()
            if isinstance(out, tuple):
                case.results["max_abs_err_residual"] = (
                    (out[1].float() - exp[1].float()).abs().max().item()
                )
                out, exp = out[0], exp[0]
            case.results["max_abs_err_vs_unfused"] = (out.float() - exp.float()).abs().max().item()


def sweep_variants(m: int, k: int, vec: int = 8):
    """(block_n, block_k, num_warps, num_stages) tiles worth timing for M tokens and width K."""
    bm = 1 << (m - 1).bit_length()
    for bn, kv, nw, st in itertools.product(
        SWEEP_BLOCK_N, SWEEP_K_VECTORS, SWEEP_WARPS, SWEEP_STAGES
    ):
        bk = kv * vec * 32 * nw
        if bm * bn <= SWEEP_MAX_ACC and bn * kv <= SWEEP_MAX_W_VECTORS and (kv == 1 or bk <= k):
            yield bn, (0 if kv == 1 else bk), nw, st


def sweep_linear(cases, inputs, timer, copy_bw, tqdm) -> list[dict]:
    from splitserve.kernels import triton_fused_linear as tfl

    impl = {
        "norm": tfl.fused_add_rms_norm_linear_impl,
        "silu": tfl.silu_mul_linear_impl,
        "plain": tfl.linear_small_m_impl,
    }
    out = []
    for case, _, _ in (c for c in cases if c[0].name in inputs):
        op, args = inputs[case.name]
        m, k = case.shape["M"], case.shape["K"]
        best = None
        vec = 16 // args[-2].element_size()  # the weight's
        for bn, bk, nw, st in tqdm(list(sweep_variants(m, k, vec)), desc=f"sweep {case.name}"):
            cfg = tfl.GemvConfig(block_n=bn, num_warps=nw, num_stages=st, block_k=bk)
            row = dict(case=case.name, block_n=bn, block_k=bk, num_warps=nw, num_stages=st)
            try:
                ms = timer(lambda cfg=cfg: impl[op](*args, config=cfg))
            except Exception as exc:  # e.g. out of shared memory / registers for a big tile
                out.append({**row, "error": str(exc)[:200]})
                continue
            row.update(us=ms * 1e3, frac_copy_bw=case.bytes / (ms * 1e-3) / copy_bw)
            out.append(row)
            if best is None or row["us"] < best["us"]:
                best = row
        if best is not None:
            default = case.results.get("triton_us", float("nan"))
            best["tuned_entry"] = (
                f"({op!r}, {1 << (m - 1).bit_length()}, {case.shape['N']}, {k}): GemvConfig("
                f"block_n={best['block_n']}, num_warps={best['num_warps']}, "
                f"num_stages={best['num_stages']}, block_k={best['block_k']}),"
            )
            tqdm.write(
                f"  best {case.name}: {best['us']:.1f} us ({100 * best['frac_copy_bw']:.1f}% copy bw; "
                f"default config {default:.1f} us)\n    TUNED entry: {best['tuned_entry']}"
            )
    return out
