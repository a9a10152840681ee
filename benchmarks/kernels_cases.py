"""The Triton kernel cases of `benchmarks/kernels.py` and the shapes they run at: elementwise
ops (RMSNorm, fused add + RMSNorm, SiLU-mul, RoPE, RoPE + KV write, KV write), KV block
pack / unpack, paged decode attention and prefill attention, each with its torch reference on
the same inputs. The small-M linear cases are in kernels_linear.py.
"""

from __future__ import annotations

# Shapes (Llama-3.2-1B: hidden 2048, intermediate 8192, 32 q heads, 8 kv heads, head_dim 64, 16 layers).
MODEL = dict(hidden=2048, inter=8192, hq=32, hkv=8, d=64, layers=16, block_size=16)
TOKENS = (64, 8192)  # elementwise ops: a decode batch and a prefill chunk
PACK_BLOCKS = (256, 512)  # KV hand-off of one 4k / 8k-token request, all layers
DECODE_SHAPES = ((1, 4096), (16, 2048), (64, 4096), (256, 1024))  # (batch, context)
PREFILL_SHAPES = ((1, 8192), (8, 1024))  # (sequences, prompt length)


def _model():
    return (MODEL[k] for k in ("hidden", "inter", "hq", "hkv", "d", "layers", "block_size"))


def add_elementwise_cases(add, Case, rnd, torch, tri, reference, gen, dev, el=2) -> None:
    """Adds, through `add`, the elementwise cases per TOKENS and the KV pack / unpack cases per
    PACK_BLOCKS, each against its eager reference op."""
    hidden, inter, hq, hkv, d, layers, bs = _model()

    # --- elementwise ops -------------------------------------------------------------------
    for t in TOKENS:
        x, r, w = rnd(t, hidden), rnd(t, hidden), rnd(hidden)
        add(
            Case(
                f"rms_norm T={t} H={hidden}",
                "rms_norm",
                dict(T=t, H=hidden),
                (2 * t + 1) * hidden * el,
            ),
            lambda x=x, w=w: tri.rms_norm(x, w, 1e-5),
            ("eager", lambda x=x, w=w: reference.rms_norm(x, w, 1e-5), True),
        )
        add(
            Case(
                f"fused_add_rms_norm T={t} H={hidden}",
                "fused_add_rms_norm",
                dict(T=t, H=hidden),
                (4 * t + 1) * hidden * el,
            ),
            lambda x=x, r=r, w=w: tri.fused_add_rms_norm(x, r, w, 1e-5),
            ("eager", lambda x=x, r=r, w=w: reference.fused_add_rms_norm(x, r, w, 1e-5), True),
        )
        gu = rnd(t, 2 * inter)
        add(
            Case(
                f"silu_and_mul T={t} I={inter}",
                "silu_and_mul",
                dict(T=t, I=inter),
                3 * t * inter * el,
            ),
            lambda gu=gu: tri.silu_and_mul(gu),
            ("eager", lambda gu=gu: reference.silu_and_mul(gu), True),
        )

        q, k, v = rnd(t, hq, d), rnd(t, hkv, d), rnd(t, hkv, d)
        pos = torch.randint(0, 8192, (t,), device=dev, generator=gen)
        inv = 1.0 / 500000.0 ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d)
        freqs = torch.arange(8192, device=dev, dtype=torch.float32)[:, None] * inv
        cs = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        add(
            Case(
                f"apply_rope T={t}",
                "apply_rope",
                dict(T=t, Hq=hq, Hkv=hkv, D=d),
                2 * t * (hq + hkv) * d * el + t * d * 4,
            ),
            lambda q=q, k=k, pos=pos, cs=cs: tri.apply_rope(q, k, pos, cs),
            ("eager", lambda q=q, k=k, pos=pos, cs=cs: reference.apply_rope(q, k, pos, cs), True),
        )
        nb = t // bs + 8
        kc, vc = rnd(nb, bs, hkv, d), rnd(nb, bs, hkv, d)
        slots = torch.randperm(nb * bs, device=dev, generator=gen)[:t]
        add(
            Case(
                f"rope_and_write_kv T={t}",
                "rope_and_write_kv",
                dict(T=t, Hq=hq, Hkv=hkv, D=d),
                2 * t * (hq + 2 * hkv) * d * el + t * d * 4,
            ),
            lambda q=q, k=k, v=v, pos=pos, cs=cs, kc=kc, vc=vc, s=slots: tri.rope_and_write_kv(
                q, k, v, pos, cs, kc, vc, s
            ),
            (
                "eager",
                lambda q=q, k=k, v=v, pos=pos, cs=cs, kc=kc, vc=vc, s=slots: (
                    reference.rope_and_write_kv(q, k, v, pos, cs, kc, vc, s)
                ),
                True,
            ),
        )
        add(
            Case(
                f"write_kv_cache T={t}",
                "write_kv_cache",
                dict(T=t, Hkv=hkv, D=d),
                4 * t * hkv * d * el,
            ),
            lambda k=k, v=v, kc=kc, vc=vc, s=slots: tri.write_kv_cache(k, v, kc, vc, s),
            (
                "eager",
                lambda k=k, v=v, kc=kc, vc=vc, s=slots: reference.write_kv_cache(k, v, kc, vc, s),
                True,
            ),
        )

    for n in PACK_BLOCKS:
        pool = rnd(layers, 2, 2 * n + 16, bs, hkv, d)
        ids = torch.randperm(2 * n + 16, device=dev, generator=gen)[:n]
        nbytes = 2 * layers * 2 * n * bs * hkv * d * el
        packed = tri.pack_kv_blocks(pool, ids)
        add(
            Case(
                f"pack_kv_blocks n={n} L={layers}",
                "pack_kv_blocks",
                dict(n=n, L=layers, BS=bs, Hkv=hkv, D=d),
                nbytes,
            ),
            lambda pool=pool, ids=ids, out=packed: tri.pack_kv_blocks(pool, ids, out),
            (
                "eager",
                lambda pool=pool, ids=ids, out=packed: reference.pack_kv_blocks(pool, ids, out),
                True,
            ),
        )
        add(
            Case(
                f"unpack_kv_blocks n={n} L={layers}",
                "unpack_kv_blocks",
                dict(n=n, L=layers, BS=bs, Hkv=hkv, D=d),
                nbytes,
            ),
            lambda pool=pool, ids=ids, p=packed: tri.unpack_kv_blocks(p, pool, ids),
            (
                "eager",
                lambda pool=pool, ids=ids, p=packed: reference.unpack_kv_blocks(p, pool, ids),
                True,
            ),
        )


def add_attention_cases(add, Case, cases, rnd, torch, tri, gen, dev, check, el=2) -> dict:
    """Adds, through `add`, paged decode attention per DECODE_SHAPES (against gather + SDPA) and
    prefill attention per PREFILL_SHAPES (against dense flash SDPA; with `check`, its max error
    vs SDPA goes into the case's results); returns {decode case name: its inputs} for --sweep."""
    from splitserve.kernels.triton_decode_attention import plan_splits

    F = torch.nn.functional
    hidden, inter, hq, hkv, d, layers, bs = _model()
    scale = d**-0.5

    # --- decode attention ---------------------------------------------------------------
    decode_inputs = {}
    for batch, ctx in DECODE_SHAPES:
        mb = ctx // bs
        nb = batch * mb + 1
        kc, vc = rnd(nb, bs, hkv, d), rnd(nb, bs, hkv, d)
        tables = (torch.randperm(nb - 1, device=dev, generator=gen) + 1)[: batch * mb].view(
            batch, mb
        )
        tables32, tables64 = tables.to(torch.int32), tables.long()
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        q = rnd(batch, hq, d)
        splits = plan_splits(batch, hkv, mb * bs, 64, q.device)
        nbytes = batch * ctx * hkv * d * el * 2 + 2 * q.numel() * el + tables32.numel() * 4

        def sdpa_paged(q=q, kc=kc, vc=vc, t=tables64, batch=batch, ctx=ctx):
            k = kc[t].view(batch, -1, hkv, d)[:, :ctx].transpose(1, 2)
            v = vc[t].view(batch, -1, hkv, d)[:, :ctx].transpose(1, 2)
            return F.scaled_dot_product_attention(
                q[:, :, None], k, v, scale=scale, enable_gqa=True
            )[:, :, 0]

        decode_inputs[f"paged_decode_attention B={batch} ctx={ctx}"] = (q, kc, vc, tables32, lens)
        add(
            Case(
                f"paged_decode_attention B={batch} ctx={ctx}",
                "paged_decode_attention",
                dict(B=batch, ctx=ctx, Hq=hq, Hkv=hkv, D=d, BS=bs, num_splits=splits),
                nbytes,
                flops=4.0 * batch * hq * ctx * d,
            ),
            lambda q=q, kc=kc, vc=vc, t=tables32, lens=lens: tri.paged_decode_attention(
                q, kc, vc, t, lens, scale
            ),
            ("gather+sdpa", sdpa_paged, True),
        )

    # --- prefill attention ------------------------------------------------------------
    for nseq, qlen in PREFILL_SHAPES:
        mb = qlen // bs
        nb = nseq * mb + 1
        kc, vc = rnd(nb, bs, hkv, d), rnd(nb, bs, hkv, d)
        tables = (
            (torch.randperm(nb - 1, device=dev, generator=gen) + 1)[: nseq * mb].view(nseq, mb)
        ).to(torch.int32)
        lens = torch.full((nseq,), qlen, dtype=torch.int32, device=dev)
        cu = torch.arange(0, nseq + 1, device=dev, dtype=torch.int32) * qlen
        q = rnd(nseq * qlen, hq, d)
        # dense contiguous K/V with the q-head count: the best case for torch's flash SDPA
        kd = (
            kc[tables.long()]
            .view(nseq, qlen, hkv, d)
            .repeat_interleave(hq // hkv, dim=2)
            .transpose(1, 2)
            .contiguous()
        )
        vd = (
            vc[tables.long()]
            .view(nseq, qlen, hkv, d)
            .repeat_interleave(hq // hkv, dim=2)
            .transpose(1, 2)
            .contiguous()
        )
        qd = q.view(nseq, qlen, hq, d).transpose(1, 2).contiguous()
        nbytes = 2 * q.numel() * el + 2 * nseq * qlen * hkv * d * el
        flops = (
            4.0 * nseq * hq * d * qlen * (qlen + 1) / 2
        )  # causal: QK^T and PV over the lower triangle
        added = add(
            Case(
                f"prefill_attention {nseq}x{qlen}",
                "prefill_attention",
                dict(num_seqs=nseq, q_len=qlen, Hq=hq, Hkv=hkv, D=d, BS=bs),
                nbytes,
                flops=flops,
            ),
            lambda q=q, kc=kc, vc=vc, t=tables, cu=cu, lens=lens, m=qlen: tri.prefill_attention(
                q, kc, vc, t, cu, lens, m, scale
            ),
            (
                "dense sdpa (flash)",
                lambda qd=qd, kd=kd, vd=vd: F.scaled_dot_product_attention(
                    qd, kd, vd, is_causal=True, scale=scale
                ),
                True,
            ),
        )
        if added and check:  # same values as the dense SDPA inputs: check agreement
            out = tri.prefill_attention(q, kc, vc, tables, cu, lens, qlen, scale).view(
                nseq, qlen, hq, d
            )
            ref = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale).transpose(
                1, 2
            )
            cases[-1][0].results["max_abs_err_vs_sdpa"] = (
                (out.float() - ref.float()).abs().max().item()
            )
    return decode_inputs
