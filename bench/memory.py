"""Activation memory at the DALL-E sequence (text 256 + 32x32 image tokens), with and without
--checkpoint_activations, and the cost of each attention pattern, in one run.

    .venv/bin/python bench/memory.py                 # depth 8, dim 512, batch 1, fp32, 2 threads
    .venv/bin/python bench/memory.py --depth 2 --dim 128 --steps 1     # a quick look
    .venv/bin/python bench/memory.py --patterns_only                    # only the attention patterns

Per mode, a fresh process trains a few steps and reports: the bytes autograd keeps for backward at the end
of the forward (the activations; exact), the process's peak resident memory (weights, gradients, Adam,
activations, allocator slack), and the step time (the median of the timed steps); a third process alternates
the two modes step by step for the step-time ratio, so that the machine's slow spells fall on both alike.
Then one attention layer's forward + backward for each pattern, computed sparsely (what training runs: on
the CPU the pieces in SDPA's fused kernel, merged by log-sum-exp), as the same pieces in plain ops (what
other devices run) and as SDPA with the dense mask (the fallback), against full causal attention, with the
fraction of the score matrix each pattern keeps and the fraction the sparse path computes (its bound on the
speed-up: full causal computes ~50%).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dalle_pytorch.models.dalle import DALLE, DALLEConfig  # noqa: E402
from dalle_pytorch.models.sparse_attention import SparseLayout, _sparse_attention_ops, sparse_attention  # noqa: E402
from dalle_pytorch.models.transformer import ATTN_TYPES, attention_mask  # noqa: E402


def config(args) -> DALLEConfig:
    return DALLEConfig(
        dim=args.dim,
        depth=args.depth,
        heads=args.heads,
        dim_head=args.dim // args.heads,
        text_seq_len=args.text_seq_len,
        num_text_tokens=10000,
        num_image_tokens=8192,
        image_fmap_size=args.fmap,
        attn_types=[args.attn_types],
    )


def one_mode(args) -> dict:
    """In this process: train `args.steps` steps (after one warm-up) with or without recomputation; with
    --interleave, both, alternating step by step, so that a slow spell of the machine falls on both alike."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = config(args)
    model = DALLE(cfg).train()
    model.transformer.checkpoint_activations = args.checkpoint
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    text = torch.randint(1, cfg.num_text_tokens, (args.batch, cfg.text_seq_len))
    image = torch.randint(0, cfg.num_image_tokens, (args.batch, cfg.image_seq_len))
    saved: dict[int, int] = {}

    def pack(t):  # every tensor autograd keeps for backward, counted once per storage
        if t.device.type == "cpu":
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    times = {False: [], True: []}
    modes = [False, True] * (args.steps + 1) if args.interleave else [args.checkpoint] * (args.steps + 1)
    for step, mode in enumerate(modes):
        model.transformer.checkpoint_activations = mode
        t = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss, _ = model(text, image)
        activation_bytes = sum(saved.values())
        saved.clear()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= (2 if args.interleave else 1):  # the first step of each mode warms up
            times[mode].append(time.perf_counter() - t)
    if args.interleave:
        return {"step_s": statistics.median(times[False]), "recomputed_step_s": statistics.median(times[True])}
    return {
        "activations_mb": activation_bytes / 2**20,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "step_s": statistics.median(times[args.checkpoint]),
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
    }


def attention_patterns(args) -> list[tuple[str, float, float, float, float, float]]:
    """Per pattern: (name, fraction of the n x n scores its mask keeps, fraction the sparse path computes,
    seconds for forward + backward of one attention layer through the sparse path, through its plain-ops
    variant, and through SDPA with the dense mask). Full causal attention is SDPA's fused is_causal path."""
    torch.set_num_threads(args.threads)
    cfg = config(args)
    n, d = cfg.seq_len, cfg.dim // cfg.heads
    q, k, v = (torch.randn(args.batch, cfg.heads, n, d, requires_grad=True) for _ in range(3))

    # every variant once per round, rounds repeated: the machine's slow spells fall on all of them alike
    variants = {"full": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
    fractions = {}
    for kind in ATTN_TYPES[1:]:
        mask = attention_mask(kind, cfg.text_seq_len, cfg.image_fmap_size)
        layout = SparseLayout(kind, mask, cfg.text_seq_len, cfg.image_fmap_size)
        variants[kind] = lambda lay=layout: sparse_attention(q, k, v, lay)
        variants[kind + " ops"] = lambda lay=layout: _sparse_attention_ops(q, k, v, lay)
        variants[kind + " dense"] = lambda m=mask: F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        fractions[kind] = (mask.float().mean().item(), layout.computed_fraction)
    times = {name: [] for name in variants}
    for round_ in range(args.repeats + 1):
        for name, fn in variants.items():
            t = time.perf_counter()
            fn().sum().backward()
            if round_:  # the first round warms up
                times[name].append(time.perf_counter() - t)
    t = {name: statistics.median(ts) for name, ts in times.items()}
    rows = [("full (causal, fused)", (n + 1) / (2 * n), (n + 1) / (2 * n), t["full"], t["full"], t["full"])]
    rows += [(kind, *fractions[kind], t[kind], t[kind + " ops"], t[kind + " dense"]) for kind in ATTN_TYPES[1:]]
    return rows


def print_memory(args, cfg, results):
    kept, rec, both = results["kept"], results["recomputed"], results["interleaved"]
    print(
        f"DALLE dim {args.dim}, depth {args.depth}, heads {args.heads}, attn_types {args.attn_types}, "
        f"sequence {cfg.seq_len} "
        f"(text {args.text_seq_len} + image {cfg.image_seq_len}), batch {args.batch}, fp32, "
        f"{kept['params_m']:.1f}M parameters, {args.threads} threads"
    )
    for name, r in (("kept", kept), ("recomputed", rec)):
        print(
            f"  activations {name:10}: {r['activations_mb']:8.1f} MiB kept for backward, peak RSS "
            f"{r['peak_rss_mb']:7.0f} MiB, step {r['step_s']:.2f} s (alone)"
        )
    print(
        f"  --checkpoint_activations: activations / {kept['activations_mb'] / rec['activations_mb']:.1f}, "
        f"peak RSS / {kept['peak_rss_mb'] / rec['peak_rss_mb']:.2f}, "
        f"step time x {both['recomputed_step_s'] / both['step_s']:.2f} "
        f"({both['step_s']:.2f} s -> {both['recomputed_step_s']:.2f} s, {args.steps} steps each, interleaved)"
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--text_seq_len", type=int, default=256)
    p.add_argument("--fmap", type=int, default=32, help="image token grid side (32x32 = 1024 tokens)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7, help="timed rounds of the attention patterns (medians)")
    p.add_argument("--attn_types", default="full", help="the model's patterns for the memory figures (full,axial_row)")
    p.add_argument("--patterns_only", action="store_true", help="only the attention patterns' timings")
    p.add_argument("--checkpoint", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--interleave", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # one mode, in a subprocess
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(one_mode(args)))
        return
    base = [a for a in (argv if argv is not None else sys.argv[1:])]
    results = {}
    cfg = config(args)
    modes = (("kept", []), ("recomputed", ["--checkpoint"]), ("interleaved", ["--interleave"]))
    for name, extra in () if args.patterns_only else modes:
        out = subprocess.run(
            [sys.executable, os.path.abspath(__file__), *base, "--one", *extra], capture_output=True, text=True
        )
        if out.returncode:
            raise SystemExit(out.stderr)
        results[name] = json.loads(out.stdout.strip().splitlines()[-1])
    if results:
        print_memory(args, cfg, results)
    rows = attention_patterns(args)
    full = rows[0][3]
    print(f"one attention layer, forward + backward, batch {args.batch}, {args.heads} heads, sequence {cfg.seq_len}:")
    for name, kept, computed, sparse, ops, dense in rows:
        line = f"  {name:20} keeps {kept:6.1%} of the scores, computes {computed:6.1%}: {sparse * 1e3:7.1f} ms"
        line += f", {full / sparse:5.2f}x full's speed (at most {rows[0][2] / computed:4.2f}x by the scores)"
        if name != rows[0][0]:
            line += f"; as plain ops {full / ops:5.2f}x; as a dense mask {full / dense:5.2f}x"
        print(line)


if __name__ == "__main__":
    main()
