"""The CUDA path, proven and measured in one run (bench/gpu.sh runs this; `--cpu` is the dry run CI keeps green).

    bash bench/gpu.sh            # on a GPU machine: under 8 minutes on one GPU, table in $OUT/gpu.txt
    bash bench/gpu.sh --cpu      # the same checks at tiny shapes on the CPU

1. the real scripts end to end on the device: train_vae.py, train_dalle.py (--checkpoint_activations),
   train_clip.py, generate.py (--compile, CLIP reranking);
2. a few steps under every backend at world size 1: single (bf16, fp16 with GradScaler), DeepSpeed ZeRO-2 and
   ZeRO-3 with fp16 (DeepSpeed's own loss scaler: an overflow forced once must be skipped and lower the
   scale), FSDP2, Horovod if it was built with CUDA; --checkpoint_activations and --compile;
3. MFU at a DALL-E-like shape (dim 1024, depth 12, heads 16, text 256 + image 32x32 tokens, bf16, the largest
   batch that fits), against the bf16 matmul peak measured in the same run;
4. sampling images/s at batch 32 (static cache eager, compiled, compiled with CUDA graphs);
5. the sparse attention patterns at 1280 tokens in bf16: the sparse path against SDPA with the dense mask
   (equal within bf16 rounding) and one layer's forward + backward time against full causal attention.
Every check prints one row of the table; a failing check says FAIL and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from common import matmul_flops, matmul_params, sync  # noqa: E402

from dalle_pytorch.models import flex  # noqa: E402
from dalle_pytorch.models.dalle import DALLE, DALLEConfig  # noqa: E402
from dalle_pytorch.models.flex import FlexLayout  # noqa: E402
from dalle_pytorch.models.sampling import generate_image_tokens  # noqa: E402
from dalle_pytorch.models.sparse_attention import SparseLayout, sparse_attention  # noqa: E402
from dalle_pytorch.models.transformer import ATTN_TYPES, attention_mask  # noqa: E402
from distributed import StepOptions, Topology, Workload, make_backend  # noqa: E402

ROWS: list[tuple[str, str, str]] = []  # (check, result, detail)


def row(check: str, result: str, detail: str = "") -> None:
    ROWS.append((check, result, detail))
    print(f"{check:52} {result:10} {detail}", flush=True)


def guarded(check: str):
    def wrap(fn):
        def run(*args, **kwargs):
            t = time.perf_counter()
            try:
                detail = fn(*args, **kwargs) or ""
                row(check, "ok", f"{detail} ({time.perf_counter() - t:.0f}s)")
            except Exception as e:  # noqa: BLE001 - one failing check must not hide the others
                traceback.print_exc()
                row(check, "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}")

        return run

    return wrap


def script(name: str, args: list[str], env: dict) -> str:
    out = subprocess.run([sys.executable, os.path.join(ROOT, name), *args], env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{name} exited {out.returncode}: {out.stderr.strip().splitlines()[-1:]}")
    return out.stdout.strip().splitlines()[-1]


def end_to_end(tmp: str, env: dict, cpu: bool) -> None:
    common = ["--output_dir", tmp, "--num_workers", "2", "--quiet", "--dataset_size", "256", "--sample_every", "0"]
    tiny_vae = ["--image_size", "32", "--num_tokens", "64", "--steps", "6", "--batch_size", "16"]
    guarded("train_vae.py")(script)("train_vae.py", [*tiny_vae, *common], env)
    vae = os.path.join(tmp, "vae", "vae.safetensors")
    dalle = ["--vae_path", vae, "--dim", "64", "--depth", "2", "--heads", "2", "--dim_head", "32", "--steps", "6"]
    guarded("train_dalle.py --checkpoint_activations --precision bf16")(script)(
        "train_dalle.py",
        [*dalle, "--text_seq_len", "16", "--checkpoint_activations", "--precision", "bf16", *common],
        env,
    )
    dalle_path = os.path.join(tmp, "dalle", "dalle.safetensors")
    clip = ["--dalle_path", dalle_path, "--dim_text", "32", "--dim_image", "32", "--dim_latent", "32", "--steps", "6"]
    guarded("train_clip.py")(script)("train_clip.py", [*clip, *common], env)
    gen = ["--dalle_path", dalle_path, "--text", "a red circle", "--num_images", "8", "--quiet"]
    gen += ["--outputs_dir", os.path.join(tmp, "out"), "--clip_path", os.path.join(tmp, "clip", "clip.safetensors")]
    guarded("generate.py --compile --keep 4 (CLIP reranking)")(script)(
        "generate.py", [*gen, "--compile", "--keep", "4"], env
    )
    guarded("python -m dalle_pytorch.eval on a caption folder (FID...)")(evaluation)(tmp, dalle_path, env)
    guarded("train_vae.py --model vqgan --precision bf16")(vqgan)(tmp, env, cpu)


def vqgan(tmp: str, env: dict, cpu: bool) -> str:
    """A VQGAN at 64 x 64 (LPIPS on a VGG-16 of fixed random values: nothing is downloaded there), its discriminator
    from half the run, in bf16: its step time, and that its export tokenizes for train_dalle.py."""
    from fid import random_vgg16

    vgg16 = random_vgg16(os.path.join(tmp, "vgg16-lpips.pth"))
    steps = 6 if cpu else 300
    args = ["--model", "vqgan", "--image_size", "64", "--num_tokens", "1024", "--num_layers", "3", "--hidden_dim", "64"]
    args += ["--perceptual_weights", vgg16, "--precision", "bf16", "--steps", str(steps), "--batch_size", "32"]
    args += ["--output_dir", tmp, "--name", "vqgan", "--num_workers", "2", "--quiet", "--log_every", "10"]
    script("train_vae.py", [*args, "--sample_every", "0", "--dataset_size", str(32 * steps)], env)
    with open(os.path.join(tmp, "vqgan", "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    step = sorted(r["seconds_per_step"] for r in rows[1:] or rows)[len(rows[1:] or rows) // 2]
    last = rows[-1]
    return (
        f"{steps} steps, {1000 * step:.0f} ms/step at batch 32, 64px; last PSNR {last['psnr']:.1f}, "
        f"codebook usage {last['codebook_usage']:.0%}"
    )


def evaluation(tmp: str, dalle_path: str, env: dict) -> str:
    """The evaluation on your data, on a caption folder of 64 built-in images; the feature extractors hold fixed
    random values (the GPU machine downloads nothing), so the FID checks the path, not the model."""
    from fid import random_weights
    from torchvision.utils import save_image

    from dalle_pytorch.data.shapes import ShapesDataset

    val, n = os.path.join(tmp, "val"), 64
    os.makedirs(val)
    data = ShapesDataset(n, 32, seed=3)
    for i in range(n):
        image, caption = data[i]
        save_image(image, os.path.join(val, f"{i}.png"))
        with open(os.path.join(val, f"{i}.txt"), "w") as f:
            f.write(caption)
    inception, vgg16 = random_weights(tmp)
    out = os.path.join(tmp, "eval")
    argv = ["-m", "dalle_pytorch.eval", "--dalle_path", dalle_path, "--image_text_folder", val, "--num_images", str(n)]
    argv += ["--inception_weights", inception, "--vgg16_weights", vgg16, "--out", out]
    t = time.perf_counter()
    done = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the evaluation exited {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
    seconds = time.perf_counter() - t
    with open(os.path.join(out, "results.json")) as f:
        fid = json.load(f)["dalle"]["fid"]
    return f"FID {fid:.1f} (random weights), {1000 * seconds / n:.0f} s per 1000 images generated and scored"


def tiny_dalle(device) -> DALLE:
    cfg = DALLEConfig(dim=64, depth=2, heads=2, dim_head=32, text_seq_len=8, num_text_tokens=64, image_fmap_size=4)
    return DALLE(cfg).to(device)


def backend_steps(name: str, precision: str, device, extra: dict | None = None, overflow: bool = False) -> str:
    """A few steps of a tiny DALLE under backend `name` at world size 1; with `overflow`, step 2's loss is
    inf: the step must be skipped and the loss scale lowered, and training must go on."""
    port = 29600 + os.getpid() % 1000
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    topo = Topology("torchrun", 0, 1, 0, 1, 0, "127.0.0.1", port)
    opts = StepOptions(precision=precision, clip_grad_norm=1.0)
    backend = make_backend(name, topo, opts, **(extra or {}))
    backend.setup()
    try:
        torch.manual_seed(0)
        model, _, _ = backend.prepare(
            tiny_dalle(backend.device),
            lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, fused=backend.device.type == "cuda"),
            lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0),
            Workload(micro_batch=4),
        )
        text = torch.randint(1, 64, (4, 8), device=backend.device)
        image = torch.randint(0, 128, (4, 16), device=backend.device)
        scales, skips = [], []
        for step in range(4):
            with backend.accumulate(model, sync=True), backend.autocast():
                loss, _ = model(text, image)
            backend.backward(loss * float("inf") if overflow and step == 1 else loss)
            result = backend.step()
            scales.append(result.loss_scale)
            skips.append(bool(result.skipped))
        if overflow and not (skips[1] and scales[1] < scales[0] and not any(skips[2:])):
            raise AssertionError(f"the forced overflow was not skipped: skipped {skips}, scales {scales}")
        return f"loss {loss.item():.3f}, skipped {skips}, scale {scales[-1]:g}"
    finally:
        backend.teardown()


def one_backend(spec: str, env: dict) -> str:
    """backend_steps in a process of its own (a process group, and DeepSpeed's, per check)."""
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--backend_check", spec], env=env, capture_output=True, text=True
    )
    if out.returncode:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}")
    return out.stdout.strip().splitlines()[-1]


def backend_check(spec: str) -> None:
    from distributed import DeepSpeedOptions

    name, precision, stage, overflow = spec.split(",")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    extra = {"deepspeed": DeepSpeedOptions(zero_stage=stage)} if name == "deepspeed" else {}
    print(backend_steps(name, precision, device, extra, overflow == "1"))


def backends(env: dict, cpu: bool) -> None:
    half = "bf16" if cpu else "fp16"  # DeepSpeed's fp16 loss scaler is GPU-only
    guarded("single bf16")(one_backend)("single,bf16,0,0", env)
    guarded("single fp16, GradScaler, forced overflow")(one_backend)("single,fp16,0,1", env)
    for stage in ("2", "3"):
        what = f"DeepSpeed ZeRO-{stage} {half}" + ("" if cpu else ", its loss scaler, forced overflow")
        guarded(what)(one_backend)(f"deepspeed,{half},{stage},{0 if cpu else 1}", env)
    guarded("FSDP2 bf16")(one_backend)("fsdp,bf16,0,0", env)
    try:
        import horovod.torch as hvd

        cuda = hvd.cuda_built() if hasattr(hvd, "cuda_built") else hvd.nccl_built()
    except ImportError:
        row("Horovod", "skipped", "horovod is not installed")
        return
    if not cpu and not cuda:
        row("Horovod", "skipped", "this Horovod was built without CUDA (build with HOROVOD_GPU_OPERATIONS=NCCL)")
        return
    hvd_env = {**env, "HOROVOD_RANK": "0", "HOROVOD_SIZE": "1", "HOROVOD_LOCAL_RANK": "0", "HOROVOD_LOCAL_SIZE": "1"}
    guarded("Horovod bf16 (1 rank)")(one_backend)("horovod,bf16,0,0", hvd_env)


def mfu(device, cpu: bool) -> str:
    """Model FLOP utilization at a DALL-E-like shape, bf16 autocast, the largest power-of-2 batch that fits."""
    if cpu:
        cfg = DALLEConfig(
            dim=64,
            depth=2,
            heads=4,
            dim_head=16,
            text_seq_len=16,
            num_text_tokens=1024,
            num_image_tokens=1024,
            image_fmap_size=8,
        )
    else:
        cfg = DALLEConfig(
            dim=1024,
            depth=12,
            heads=16,
            dim_head=64,
            text_seq_len=256,
            num_text_tokens=16384,
            num_image_tokens=8192,
            image_fmap_size=32,
        )
    dtype = torch.bfloat16
    peak = matmul_flops(512 if cpu else 8192, dtype, device, seconds=1.0 if cpu else 5.0)
    model = DALLE(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    n = matmul_params(model)

    def step(batch: int) -> float:
        text = torch.randint(1, cfg.num_text_tokens, (batch, cfg.text_seq_len), device=device)
        image = torch.randint(0, cfg.num_image_tokens, (batch, cfg.image_seq_len), device=device)
        times = []
        for _ in range(2 if cpu else 6):
            sync(device)
            t = time.perf_counter()
            with torch.autocast(device.type, dtype=dtype):
                loss, _ = model(text, image)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync(device)
            times.append(time.perf_counter() - t)
        return min(times[1:])

    batch, best = 1, None
    while batch <= (4 if cpu else 256):
        try:
            best = (batch, step(batch))
        except torch.OutOfMemoryError:
            break
        batch *= 2
    if device.type == "cuda":
        torch.cuda.empty_cache()
    batch, seconds = best
    tokens = batch * cfg.seq_len
    # 6 N per token for the matmuls, plus attention's QK^T and AV: 12 x depth x seq x (heads x dim_head)
    flops = 6 * n * tokens + 12 * cfg.depth * cfg.seq_len * cfg.heads * cfg.dim_head * tokens
    return (
        f"MFU {flops / seconds / peak:.1%} at batch {batch} ({tokens / seconds:.0f} tokens/s, "
        f"{flops / seconds / 1e12:.2f} TFLOP/s of a measured {peak / 1e12:.2f} TFLOP/s bf16 peak, "
        f"{n / 1e6:.0f}M matmul params)"
    )


def sampling(device, cpu: bool) -> str:
    """images/s at batch 32 at bench/sample.py's shape (64x64 images as 16x16 tokens, text 32, dim 256, depth 4)."""
    cfg = DALLEConfig(
        dim=256,
        depth=4,
        heads=4,
        dim_head=64,
        text_seq_len=32,
        num_text_tokens=1024,
        num_image_tokens=1024,
        image_fmap_size=8 if cpu else 16,
    )
    model = DALLE(cfg).eval().to(device)
    text = torch.randint(1, 1024, (32, cfg.text_seq_len), device=device)
    modes = {"cache": False, "compiled": True}
    if device.type == "cuda":
        modes["CUDA graphs"] = "reduce-overhead"
    out = []
    with torch.no_grad():
        for name, compile in modes.items():
            for _ in range(2):  # the first run compiles (and records the graph)
                sync(device)
                t = time.perf_counter()
                generate_image_tokens(model, text, generator=torch.Generator(device).manual_seed(0), compile=compile)
                sync(device)
            out.append(f"{name} {32 / (time.perf_counter() - t):.1f}")
    return "images/s: " + ", ".join(out)


def attention_patterns(device, cpu: bool) -> str:
    """One attention layer (batch 8, 16 heads of 64, text 256 + image 32x32, bf16), forward + backward: each
    sparse pattern's speed against full causal attention (SDPA's fused kernel), after checking its outputs and
    gradients against SDPA with the dense mask. On CUDA the patterns run through FlexAttention (flex.py), with
    128-wide tiles and, for axial_row, narrower key tiles too; on the CPU through the fused pieces."""
    text_len, fmap, batch, heads = (8, 4, 2, 2) if cpu else (256, 32, 8, 16)
    dtype = torch.float32 if cpu else torch.bfloat16
    n = text_len + fmap * fmap
    q, k, v = (torch.randn(batch, heads, n, 64, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    g = torch.randn(batch, heads, n, 64, device=device, dtype=dtype)

    def timed(fn, repeats=10):
        for _ in range(2):
            fn().backward(g)
        sync(device)
        t = time.perf_counter()
        for _ in range(repeats):
            fn().backward(g)
        sync(device)
        return (time.perf_counter() - t) / repeats

    def check(kind, got, want):
        outs = [got(), want()]
        grads = [torch.autograd.grad(o, (q, k, v), g) for o in outs]
        for name, a, e in [("output", *outs), *zip(("dq", "dk", "dv"), *grads)]:
            err = ((a.float() - e.float()).abs().max() / e.float().abs().max().clamp(min=1e-6)).item()
            if err > (1e-5 if cpu else 2e-2):
                raise AssertionError(f"{kind}: {name} differs from the dense mask's by {err:.1e} (relative to its max)")

    full = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    out = []
    for kind in ATTN_TYPES[1:]:
        mask = attention_mask(kind, text_len, fmap).to(device)
        layout = SparseLayout(kind, mask.cpu(), text_len, fmap).to(device)
        tilings = {"": layout}
        if kind == "axial_row" and layout.flex is not None:
            for tiles in ((128, 64), (64, 64)):
                variant = SparseLayout(kind, mask.cpu(), text_len, fmap)
                variant.flex = FlexLayout(mask.cpu(), tiles)
                tilings[f" tiles {tiles[0]}x{tiles[1]}"] = variant.to(device)
        for label, lay in tilings.items():
            dense = lambda m=mask: F.scaled_dot_product_attention(q, k, v, attn_mask=m)  # noqa: E731
            check(kind, lambda lay=lay: sparse_attention(q, k, v, lay), dense)
            t = timed(lambda lay=lay: sparse_attention(q, k, v, lay))
            computed = lay.flex.computed_fraction if lay.flex is not None else lay.computed_fraction
            out.append(f"{kind}{label} {full / t:.2f}x ({computed:.0%} computed)")
    path = "FlexAttention" if layout.flex is not None and device.type in flex.DEVICES else "fused pieces"
    return f"{path}, outputs and gradients checked; vs full causal ({full * 1e3:.2f} ms): " + ", ".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="the dry run: tiny shapes on the CPU")
    p.add_argument("--out", default=os.environ.get("OUT", "bench-gpu"), help="folder for gpu.txt")
    p.add_argument("--backend_check", default="", help=argparse.SUPPRESS)  # one backend's steps, in a subprocess
    args = p.parse_args(argv)
    if args.backend_check:
        return backend_check(args.backend_check)
    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run `bash bench/gpu.sh --cpu` for the dry run")
    device = torch.device("cpu" if args.cpu else "cuda")
    env = {**os.environ, "PYTHONPATH": ROOT}
    if args.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    name = "CPU dry run" if args.cpu else torch.cuda.get_device_name()
    print(f"device: {name}, torch {torch.__version__}", flush=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        end_to_end(tmp, env, args.cpu)
    backends(env, args.cpu)
    guarded("MFU, DALL-E-like shape, bf16")(lambda: mfu(device, args.cpu))()
    guarded("sampling at batch 32")(lambda: sampling(device, args.cpu))()
    guarded("sparse attention patterns, 1280 tokens, bf16")(lambda: attention_patterns(device, args.cpu))()
    os.makedirs(args.out, exist_ok=True)
    lines = [f"device: {name}, torch {torch.__version__}, {time.perf_counter() - start:.0f}s"]
    lines += [f"{c:52} {r:10} {d}" for c, r, d in ROWS]
    with open(os.path.join(args.out, "gpu.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(["", *lines, f"table: {os.path.join(args.out, 'gpu.txt')}"]))
    return 1 if any(r == "FAIL" for _, r, _ in ROWS) else 0


if __name__ == "__main__":
    sys.exit(main())
