"""Sampling speed against the compute bound, in one run; and speculative Jacobi decoding against sequential.

    .venv/bin/python bench/sample.py            # image 64x64 with 16x16 tokens, text 32, dim 256, depth 4, batch 4
    .venv/bin/python bench/sample.py --dalle_path runs/dalle/dalle.safetensors --sjd 4 8 16 --batch 1

--sjd W ...: also decode by SJD with each window W, reporting forward passes per image, images/s and the ratio to
sequential decoding with the KV cache in the same run. A random model's next-token distributions are nearly
uniform, which SJD's drafts match by chance: its figures flatter SJD; measure a trained DALLE (--dalle_path, the
built-in data's captions).

The bound: 2 x parameters x generated tokens FLOPs at the measured dense matmul FLOP/s. The KV cache
makes the real work close to that (each new token is one row through the model).
"""

from __future__ import annotations

import argparse
import time

import torch
from common import add_model_args, matmul_flops, matmul_params, model_config, sync

from dalle_pytorch.models.dalle import DALLE
from dalle_pytorch.models.sampling import generate_image_tokens


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--no_cache", action="store_true", help="also time the uncached path")
    p.add_argument("--compile", action="store_true", help="also time the torch.compile'd decode step")
    p.add_argument("--sjd", type=int, nargs="*", default=[], help="also time SJD with these windows")
    p.add_argument("--dalle_path", default="", help="a trained DALLE export (default: a random model of the flags)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--cond_scale", type=float, default=1.0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    peak = matmul_flops(2048, torch.float32, device)
    if args.dalle_path:
        from dalle_pytorch.data.shapes import ShapesDataset
        from dalle_pytorch.inference.load import load_dalle

        model, _, tokenizer = load_dalle(args.dalle_path, device)
        cfg = model.cfg
        captions = [ShapesDataset(args.batch, seed=7).caption(i) for i in range(args.batch)]
        text = tokenizer.captions(captions, cfg.text_seq_len)[0].to(device)
    else:
        cfg = model_config(args)
        model = DALLE(cfg).eval().to(device)
        text = torch.randint(1, 1024, (args.batch, cfg.text_seq_len), device=device)
    n_params = matmul_params(model)
    sampling = dict(temperature=args.temperature, cond_scale=args.cond_scale)

    modes = {"cache": dict(use_cache=True)}
    if args.compile:
        modes["compiled"] = dict(use_cache=True, compile=True)
    if args.no_cache:
        modes["no cache"] = dict(use_cache=False)
    for w in args.sjd:
        modes[f"sjd window {w}"] = dict(decoding="sjd", window=w)
    results = {}
    with torch.no_grad():
        for name, kw in modes.items():
            kw = {**sampling, **kw}
            generate_image_tokens(model, text, generator=torch.Generator(device).manual_seed(0), **kw)  # warm-up
            sync(device)
            t = time.perf_counter()
            for _ in range(args.repeats):
                generate_image_tokens(model, text, generator=torch.Generator(device).manual_seed(0), **kw)
            sync(device)
            results[name] = (time.perf_counter() - t) / args.repeats
        floor, kernel = linear_floor(model, args.batch, device)
        passes = {name: sjd_passes(model, text, int(name.split()[-1]), sampling) for name in results if "sjd" in name}
    generated = args.batch * cfg.image_seq_len
    bound = 2 * n_params * generated / peak  # seconds at the matmul peak
    print(
        f"device {device}, fp32, threads {torch.get_num_threads()}; "
        f"{n_params / 1e6:.2f}M matmul parameters, batch {args.batch}"
    )
    print(f"measured dense matmul peak: {peak / 1e9:.1f} GFLOP/s")
    print(f"compute bound: {bound:.3f} s per batch")
    for name, t in results.items():
        print(
            f"{name}: {t:.3f} s per batch, {args.batch / t:.2f} images/s, {generated / t:.0f} tokens/s, "
            f"{bound / t:.1%} of the bound"
        )
    for name, (n_passes, mean_kept) in passes.items():
        print(
            f"{name}: {n_passes:.1f} forward passes per batch against {cfg.image_seq_len + 1} sequential "
            f"({(cfg.image_seq_len + 1) / n_passes:.2f}x fewer; {mean_kept:.2f} tokens kept per pass and row), "
            f"{results['cache'] / results[name]:.2f}x the images/s of sequential decoding with the cache"
        )
    steps = cfg.image_seq_len
    print(
        f"the model's linear layers alone ({kernel}), one token row each at batch {args.batch}: "
        f"{floor * 1e3:.3f} ms per step, {floor * steps:.3f} s per batch = {bound / (floor * steps):.1%} of the "
        "bound (a ceiling for any decoder at this batch on this device)"
    )


def sjd_passes(model, text, window: int, sampling: dict, repeats: int = 3) -> tuple[float, float]:
    """(forward passes per batch, tokens kept per pass and row) of SJD, the mean over seeds."""
    from dalle_pytorch.models.sjd import generate_sjd

    n, kept = [], []
    for seed in range(repeats):
        stats = {}
        generate_sjd(model, text, window=window, generator=torch.Generator(text.device).manual_seed(seed),
                     stats=stats, **sampling)  # fmt: skip
        n.append(stats["passes"])
        a = stats["accepted"]
        kept.append(float(a[a > 0].float().mean()))
    return sum(n) / len(n), sum(kept) / len(kept)


def linear_floor(model, batch: int, device, repeats: int = 300) -> tuple[float, str]:
    """Seconds per decode step spent in the model's nn.Linear layers alone, each on a (batch, in) input,
    back to back as a step runs them, with the fastest kernel at hand: torch's linear, or on CPU MKL's
    prepacked linear (what inductor's freezing uses). At small batch these matmuls are bound by memory and
    latency, far below the large-matmul peak."""
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.randn(batch, m.in_features, device=device) for m in layers]
    candidates = {"torch linear": lambda: [m(x) for m, x in zip(layers, inputs)]}
    if device.type == "cpu" and torch.backends.mkl.is_available():
        packed = [torch.ops.mkl._mkl_reorder_linear_weight(m.weight.detach(), batch) for m in layers]
        candidates["MKL prepacked linear"] = lambda: [
            torch.ops.mkl._mkl_linear(x, w, m.weight, m.bias, batch) for m, x, w in zip(layers, inputs, packed)
        ]
    best = (float("inf"), "")
    for name, fn in candidates.items():
        for _ in range(20):
            fn()
        sync(device)
        t = time.perf_counter()
        for _ in range(repeats):
            fn()
        sync(device)
        best = min(best, ((time.perf_counter() - t) / repeats, name))
    return best


if __name__ == "__main__":
    main()
