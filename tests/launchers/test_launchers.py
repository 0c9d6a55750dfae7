"""The real scripts under the real launchers on 2 local ranks over Gloo.

Equivalence: 2 ranks x batch b (x accumulation) must give the parameters of 1 process with the whole
batch, within float tolerance, on every backend. The sampler gives rank r the samples r, r+2, ... of
the same permutation, so both see the same samples per step. Clipping is active in these runs (gradient
norm > --clip_grad_norm), so a backend that clipped unsynchronized per-rank gradients would fail here.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import ROOT
from launch import (
    BIN,
    FAR,
    NORM_RTOL,
    PORTS,
    TINY_VAE,
    assert_same,
    dalle_args,
    grad_norms,
    launch,
    restart_from_step_2,
)

import generate
import train_dalle
from dalle_pytorch.convert import convert
from dalle_pytorch.files import safe_load
from dalle_pytorch.training.checkpoints import step_dirs
from distributed.checkpoint_io import load_shared_file


def test_assert_same_catches_one_wrong_tensor():
    """One small tensor off by 1e-2, or all of it a little off, among 40k right weights is caught and named;
    pooled over all weights, the second would be 0.08% of them and pass."""
    g = torch.Generator().manual_seed(0)
    a = {"big.weight": torch.randn(200, 200, generator=g), "small.bias": torch.randn(32, generator=g)}

    def changed(name, delta):
        return {k: v + delta if k == name else v for k, v in a.items()}

    assert_same(a, a)
    assert_same(a, changed("small.bias", torch.eye(32)[0] * 5e-4))  # one element beyond CLOSE, within FAR
    with pytest.raises(AssertionError, match=r"small\.bias \(32,\): max difference 1\.00e-02"):
        assert_same(a, changed("small.bias", torch.eye(32)[3] * 1e-2))
    with pytest.raises(AssertionError, match=r"small\.bias .* 32 of 32 elements beyond"):
        assert_same(a, changed("small.bias", torch.full((32,), 1e-4)))
    with pytest.raises(AssertionError, match=r"big\.weight"):  # 1% of one tensor
        assert_same(a, changed("big.weight", (torch.rand(200, 200, generator=g) < 0.01) * 1e-4))


CASES = [
    ("torchrun", ["--distributed_backend", "ddp"]),
    ("torchrun-fsdp", ["--distributed_backend", "fsdp"]),
    ("deepspeed", ["--zero_stage", "1"]),
    ("deepspeed", ["--zero_stage", "2"]),
    ("deepspeed", ["--zero_stage", "3"]),
    ("horovod", []),
    ("ray", ["--distributed_backend", "ddp"]),  # Ray Train workers; FSDP on Ray: tests/cluster/test_ray.py
    ("ray", ["--distributed_backend", "deepspeed", "--zero_stage", "2"]),
]


# Ray's DDP case (33 s: a local Ray started for it) runs under `make test-all`; make test keeps Ray's ZeRO-2 one and
# the cluster tier's Ray tests (FSDP on 2 hosts, an elastic run)
SLOW_CASES = {("ray", "ddp")}


@pytest.mark.parametrize(
    "kind,extra",
    [pytest.param(k, e, marks=[pytest.mark.slow] if (k, e[-1] if e else "") in SLOW_CASES else []) for k, e in CASES],
    ids=[f"{k}{'-' + e[-1] if e else ''}" for k, e in CASES],
)
@pytest.mark.parametrize("accumulate", [False, True], ids=["no-accum", "accum2"])
def test_two_ranks_equal_one_process(kind, extra, accumulate, vae_path, reference, tmp_path):
    if accumulate and kind in ("torchrun-fsdp",) or accumulate and extra[-1:] in (["1"], ["3"]):
        pytest.skip("accumulation is covered on ddp, ZeRO-2 and horovod; the others share their code path")
    if kind == "ray" and accumulate == (extra[-1] == "ddp"):
        pytest.skip("Ray (a cluster started per test): DDP without accumulation, ZeRO-2 with it")
    more = ["--global_batch_size", "16"] if accumulate else []
    launch(kind, "train_dalle.py", dalle_args(vae_path, str(tmp_path), 4, extra=[*extra, *more]))
    run = os.path.join(tmp_path, "dalle")
    ref_weights, ref_norms = reference[16 if accumulate else 8]
    assert max(ref_norms) > 1.0  # clipping is active
    assert grad_norms(run) == pytest.approx(ref_norms, rel=NORM_RTOL)
    assert_same(ref_weights, safe_load(os.path.join(run, "dalle.safetensors"))["weights"])
    config = json.load(open(os.path.join(run, "config.json")))
    assert config["derived"]["world_size"] == 2 and config["derived"]["accumulation_steps"] == (2 if accumulate else 1)
    assert config["derived"]["launcher"] == kind.split("-")[0]
    assert os.path.exists(os.path.join(run, "samples", "step-00000002.png"))
    if not accumulate and kind != "horovod":
        # the final resume checkpoint, sharded or not, converts to the same export, which generates anywhere
        converted = convert(step_dirs(os.path.join(run, "checkpoints"))[0], os.path.join(run, "converted.pt"))
        assert_same(safe_load(os.path.join(run, "dalle.safetensors"))["weights"], safe_load(converted)["weights"])
        folders = generate.main(
            [
                "--dalle_path",
                converted,
                "--text",
                "a red circle",
                "--num_images",
                "2",
                "--outputs_dir",
                str(tmp_path / "out"),
                "--quiet",
            ]
        )
        assert len([f for f in os.listdir(folders[0]) if f.endswith(".png")]) == 3  # 2 images and the grid


def test_horovod_fp16_compression(vae_path, reference, tmp_path):
    """--horovod_compression fp16: gradients cross the ring in fp16 and come back to fp32, so the run
    follows the uncompressed one up to fp16 rounding of the gradients."""
    launch("horovod", "train_dalle.py", dalle_args(vae_path, str(tmp_path), 4, extra=["--horovod_compression", "fp16"]))
    run = os.path.join(tmp_path, "dalle")
    ref_weights, ref_norms = reference[8]
    # step 1 starts from the same weights: fp32 runs agree on its gradient norm to ~1e-7 (summation order),
    # fp16 rounding (2**-11 per element) moves it by ~1e-5: visible, so the compression is on, and small
    first = abs(grad_norms(run)[0] / ref_norms[0] - 1)
    assert 2e-6 < first < 5e-4, first
    assert grad_norms(run) == pytest.approx(ref_norms, rel=5e-4)
    weights = safe_load(os.path.join(run, "dalle.safetensors"))["weights"]
    # measured: max 1.2e-3; the most affected tensor, layers.1.attn.to_qkv.weight, has 1.6% beyond CLOSE
    assert_same(ref_weights, weights, far=3 * FAR, beyond_close=0.02)


@pytest.mark.parametrize("kind", ["torchrun", "deepspeed", "horovod"])
def test_train_vae_under_launcher(kind, tmp_path):
    launch(kind, "train_vae.py", [*TINY_VAE, "--batch_size", "4", "--steps", "2", "--output_dir", str(tmp_path)])
    run = os.path.join(tmp_path, "vae")
    assert os.path.exists(os.path.join(run, "vae.safetensors"))
    assert json.load(open(os.path.join(run, "config.json")))["derived"]["world_size"] == 2


def test_two_nodes_on_loopback(vae_path, tmp_path):
    """torchrun --nnodes 2: two 'nodes' of one process each, sharing a static rendezvous on 127.0.0.1."""
    port = str(next(PORTS))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    args = dalle_args(vae_path, str(tmp_path), 4)
    procs = [
        subprocess.Popen(
            [
                os.path.join(BIN, "torchrun"),
                "--nnodes",
                "2",
                "--node_rank",
                str(node),
                "--nproc_per_node",
                "1",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                port,
                os.path.join(ROOT, "train_dalle.py"),
                *args,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
        )
        for node in (0, 1)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][-3000:] + outs[1][-3000:]
    config = json.load(open(os.path.join(tmp_path, "dalle", "config.json")))
    assert config["derived"]["world_size"] == 2 and config["derived"]["launcher"] == "torchrun"


def test_horovod_clips_synchronized_gradients():
    out = subprocess.run(
        [
            os.path.join(BIN, "horovodrun"),
            "--gloo",
            "-np",
            "2",
            "-H",
            "localhost:2",
            sys.executable,
            os.path.join(ROOT, "tests", "horovod_clip_check.py"),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("CLIP_OK") == 2


@pytest.mark.launchers  # 30-65 s each: make test-launchers
def test_resume_across_backends_and_world_sizes(vae_path, tmp_path):
    """A DDP checkpoint of 2 ranks resumes under Horovod and DeepSpeed ZeRO-1 on 2 ranks, an FSDP one in a
    single process, and each reaches the parameters of the uninterrupted DDP run."""
    base = dalle_args(vae_path, str(tmp_path / "ddp"), 4, steps=4, extra=["--keep_n_checkpoints", "5"])
    launch("torchrun", "train_dalle.py", [*base, "--distributed_backend", "ddp"])
    run = tmp_path / "ddp" / "dalle"
    full = safe_load(str(run / "dalle.safetensors"))["weights"]

    restart_from_step_2(run, tmp_path / "hvd" / "dalle")
    launch("horovod", "train_dalle.py", [*dalle_args(vae_path, str(tmp_path / "hvd"), 4, steps=4), "--resume", "auto"])
    assert_same(full, safe_load(str(tmp_path / "hvd" / "dalle" / "dalle.safetensors"))["weights"])

    restart_from_step_2(run, tmp_path / "ds" / "dalle")
    ds = dalle_args(vae_path, str(tmp_path / "ds"), 4, steps=4, extra=["--zero_stage", "1"])
    assert "step-00000002 at step 2" in launch("deepspeed", "train_dalle.py", [*ds, "--resume", "auto"])
    assert_same(full, safe_load(str(tmp_path / "ds" / "dalle" / "dalle.safetensors"))["weights"])

    fsdp = dalle_args(vae_path, str(tmp_path / "fsdp"), 4, steps=4, extra=["--keep_n_checkpoints", "5"])
    launch("torchrun", "train_dalle.py", [*fsdp, "--distributed_backend", "fsdp"])
    restart_from_step_2(tmp_path / "fsdp" / "dalle", tmp_path / "one" / "dalle")
    # one process accumulates 2 x 4 for the global batch of 8, from the sharded 2-rank checkpoint and
    # from its data position (samples consumed by all ranks, not per-rank batches)
    one = dalle_args(vae_path, str(tmp_path / "one"), 4, steps=4, extra=["--global_batch_size", "8"])
    train_dalle.main([*one, "--resume", "auto"])
    assert_same(full, safe_load(str(tmp_path / "one" / "dalle" / "dalle.safetensors"))["weights"])


@pytest.mark.launchers  # 30-65 s each: make test-launchers
@pytest.mark.slow  # 40 s: DeepSpeed's own checkpoint resumed by make test's ZeRO-3 json-stage test; make test-all
def test_deepspeed_resume_equals_uninterrupted(vae_path, tmp_path):
    args = ["--keep_n_checkpoints", "5", "--zero_stage", "2"]
    launch("deepspeed", "train_dalle.py", dalle_args(vae_path, str(tmp_path / "a"), 4, steps=4, extra=args))
    full = safe_load(str(tmp_path / "a" / "dalle" / "dalle.safetensors"))["weights"]
    restart_from_step_2(tmp_path / "a" / "dalle", tmp_path / "b" / "dalle")
    out = launch(
        "deepspeed",
        "train_dalle.py",
        [*dalle_args(vae_path, str(tmp_path / "b"), 4, steps=4, extra=args), "--resume", "auto"],
    )
    assert "resumed from" in out and "step-00000002" in out
    assert_same(full, safe_load(str(tmp_path / "b" / "dalle" / "dalle.safetensors"))["weights"])


@pytest.mark.launchers  # 30-65 s each: make test-launchers
def test_deepspeed_json_stage_with_zero_stage_auto(vae_path, tmp_path):
    """ZeRO-3 set in --deepspeed_config, --zero_stage auto: trained, exported and resumed (from DeepSpeed's own
    checkpoint, whose layout says stage 3) as ZeRO-3, reaching the uninterrupted run's parameters."""
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    args = ["--keep_n_checkpoints", "5", "--zero_stage", "auto", "--deepspeed_config", str(config)]
    out = launch("deepspeed", "train_dalle.py", dalle_args(vae_path, str(tmp_path / "a"), 4, steps=4, extra=args))
    assert "--zero_stage auto: ZeRO-3, set in --deepspeed_config" in out
    run = tmp_path / "a" / "dalle"
    assert load_shared_file(str(run / "checkpoints" / "step-00000004"))["deepspeed"]["zero_stage"] == 3
    full = safe_load(str(run / "dalle.safetensors"))["weights"]
    restart_from_step_2(run, tmp_path / "b" / "dalle")
    resumed = [*dalle_args(vae_path, str(tmp_path / "b"), 4, steps=4, extra=args), "--resume", "auto"]
    out = launch("deepspeed", "train_dalle.py", resumed)
    assert "step-00000002 at step 2" in out and "portable" not in out  # the ZeRO-3 layout matched
    assert_same(full, safe_load(str(tmp_path / "b" / "dalle" / "dalle.safetensors"))["weights"])


@pytest.mark.launchers  # 30-65 s each: make test-launchers
def test_deepspeed_checkpoint_resumes_anywhere(vae_path, tmp_path, capsys):
    """A ZeRO-2 checkpoint of 2 ranks resumes under Horovod on 2 ranks, in one process, and under ZeRO-3
    (DeepSpeed's own format cannot change stage), also with the optimizer offloaded; each reaches the
    uninterrupted run's parameters."""
    base = ["--keep_n_checkpoints", "5"]
    launch(
        "deepspeed",
        "train_dalle.py",
        dalle_args(vae_path, str(tmp_path / "ds"), 4, steps=4, extra=[*base, "--zero_stage", "2"]),
    )
    run = tmp_path / "ds" / "dalle"
    full = safe_load(str(run / "dalle.safetensors"))["weights"]

    restart_from_step_2(run, tmp_path / "hvd" / "dalle")
    out = launch(
        "horovod", "train_dalle.py", [*dalle_args(vae_path, str(tmp_path / "hvd"), 4, steps=4), "--resume", "auto"]
    )
    assert "resumed from" in out and "step-00000002" in out  # not a fallback to the step-0 checkpoint
    assert_same(full, safe_load(str(tmp_path / "hvd" / "dalle" / "dalle.safetensors"))["weights"])

    restart_from_step_2(run, tmp_path / "one" / "dalle")
    train_dalle.main([*dalle_args(vae_path, str(tmp_path / "one"), 8, steps=4), "--resume", "auto"])
    assert "step-00000002 at step 2" in capsys.readouterr().out
    assert_same(full, safe_load(str(tmp_path / "one" / "dalle" / "dalle.safetensors"))["weights"])

    restart_from_step_2(run, tmp_path / "z3" / "dalle")
    z3 = dalle_args(vae_path, str(tmp_path / "z3"), 4, steps=4, extra=["--zero_stage", "3"])
    out = launch("deepspeed", "train_dalle.py", [*z3, "--resume", "auto"])
    assert "portable" in out and "step-00000002 at step 2" in out
    assert_same(full, safe_load(str(tmp_path / "z3" / "dalle" / "dalle.safetensors"))["weights"])

    # the optimizer offloaded to the CPU keeps persistent gradient buffers that loading must not drop
    restart_from_step_2(run, tmp_path / "off" / "dalle")
    off = dalle_args(vae_path, str(tmp_path / "off"), 4, steps=4, extra=["--zero_stage", "3", "--offload_optimizer"])
    assert "step-00000002 at step 2" in launch("deepspeed", "train_dalle.py", [*off, "--resume", "auto"])
    assert_same(full, safe_load(str(tmp_path / "off" / "dalle" / "dalle.safetensors"))["weights"])


@pytest.mark.launchers  # 30-65 s each: make test-launchers
def test_deepspeed_stage0_bf16_checkpoint_resumes_under_zero2(vae_path, tmp_path):
    """ZeRO stage 0 in bf16 steps fp32 copies of the weights that are not the module's parameters: the
    portable checkpoint must carry those copies and their Adam moments, or the resumed run drifts."""
    args = ["--keep_n_checkpoints", "5", "--precision", "bf16"]
    launch("deepspeed", "train_dalle.py", dalle_args(vae_path, str(tmp_path / "a"), 4, 4, [*args, "--zero_stage", "0"]))
    full = safe_load(str(tmp_path / "a" / "dalle" / "dalle.safetensors"))["weights"]
    restart_from_step_2(tmp_path / "a" / "dalle", tmp_path / "b" / "dalle")
    resumed = dalle_args(vae_path, str(tmp_path / "b"), 4, 4, [*args, "--zero_stage", "2"])
    assert "step-00000002 at step 2" in launch("deepspeed", "train_dalle.py", [*resumed, "--resume", "auto"])
    assert_same(full, safe_load(str(tmp_path / "b" / "dalle" / "dalle.safetensors"))["weights"])


@pytest.mark.launchers
def test_shared_layers_on_two_zero3_ranks_equal_one_process(vae_path, tmp_path):
    """--shared_attn_ids / --shared_ff_ids (one module in several blocks) under ZeRO-3, which partitions
    each parameter once however many blocks use it: 2 ranks equal 1 process with the whole batch."""
    shared = ["--shared_attn_ids", "0,0", "--shared_ff_ids", "0"]
    train_dalle.main(dalle_args(vae_path, str(tmp_path / "one"), 8, extra=shared))
    launch(
        "deepspeed",
        "train_dalle.py",
        dalle_args(vae_path, str(tmp_path / "two"), 4, extra=[*shared, "--zero_stage", "3"]),
    )
    one, two = (os.path.join(tmp_path, d, "dalle") for d in ("one", "two"))
    assert grad_norms(two) == pytest.approx(grad_norms(one), rel=NORM_RTOL)
    weights = safe_load(os.path.join(two, "dalle.safetensors"))["weights"]
    assert_same(safe_load(os.path.join(one, "dalle.safetensors"))["weights"], weights)
    assert torch.equal(
        weights["transformer.layers.0.ff.proj_in.weight"], weights["transformer.layers.1.ff.proj_in.weight"]
    )


def test_config_yaml_relaunches_the_run(vae_path, tmp_path):
    """A run's config.yaml holds its flags: `--config .../config.yaml --resume auto` alone (and where the copy
    lies) relaunches it under torchrun: cut after step 2, it resumes to the uninterrupted run's weights."""
    base = dalle_args(vae_path, str(tmp_path / "a"), 4, steps=4, extra=["--keep_n_checkpoints", "5"])
    launch("torchrun", "train_dalle.py", [*base, "--distributed_backend", "ddp"])
    run = tmp_path / "a" / "dalle"
    restart_from_step_2(run, tmp_path / "b" / "dalle")
    config = str(tmp_path / "b" / "dalle" / "config.yaml")
    out = launch(
        "torchrun", "train_dalle.py", ["--config", config, "--resume", "auto", "--output_dir", str(tmp_path / "b")]
    )
    assert "step-00000002 at step 2" in out
    assert_same(
        safe_load(str(run / "dalle.safetensors"))["weights"],
        safe_load(str(tmp_path / "b" / "dalle" / "dalle.safetensors"))["weights"],
    )


def test_hooks_run_on_every_rank_and_stop_them_together(vae_path, tmp_path):
    """--hooks under torchrun: the early stopping example (and a hook that notes its rank) runs on both ranks,
    which stop at the same step with a checkpoint and the export."""
    (tmp_path / "note.py").write_text(
        "import os\nfrom dalle_pytorch.training.hooks import Hooks\n\nclass Note(Hooks):\n"
        "    def on_end(self, ctx, step):\n"
        "        open(os.path.join(ctx.run_dir, f'end-{ctx.rank}-of-{ctx.world_size}'), 'w').write(str(step))\n"
    )
    hooks = f"{ROOT}/examples/hooks/early_stopping.py:EarlyStopping,{tmp_path / 'note.py'}:Note"
    args = dalle_args(vae_path, str(tmp_path), 4, steps=40, extra=["--hooks", hooks, "--log_every", "2"])
    os.environ.update(EARLY_STOPPING_KEY="loss", EARLY_STOPPING_PATIENCE="1", EARLY_STOPPING_MIN_DELTA="1e9")
    try:
        launch("torchrun", "train_dalle.py", args)
    finally:
        for key in ("EARLY_STOPPING_KEY", "EARLY_STOPPING_PATIENCE", "EARLY_STOPPING_MIN_DELTA"):
            del os.environ[key]
    run = tmp_path / "dalle"
    ends = [(run / f"end-{r}-of-2").read_text() for r in (0, 1)]
    assert ends == ["5", "5"], ends  # asked at the second log (step 4), stopped after step 5 on both
    assert "early stopping: loss" in (run / "train.log").read_text()
    assert os.path.basename(step_dirs(str(run / "checkpoints"))[0]) == "step-00000005"
    assert (run / "dalle.safetensors").exists()


@pytest.fixture(scope="module")
def ema_reference(vae_path, tmp_path_factory):
    """One process, the whole batch of 8, 4 steps, --ema 0.9: its export (raw weights and their average)."""
    out = str(tmp_path_factory.mktemp("ema_ref"))
    return safe_load(train_dalle.main(dalle_args(vae_path, out, 8, steps=4, extra=["--ema", "0.9"])))


EMA_CASES = [
    ("torchrun-fsdp", ["--distributed_backend", "fsdp"]),
    ("deepspeed", ["--zero_stage", "2"]),
    ("deepspeed", ["--zero_stage", "3"]),
    ("horovod", []),
]


@pytest.mark.parametrize("kind,extra", EMA_CASES, ids=[f"{k}{'-' + e[-1] if e else ''}" for k, e in EMA_CASES])
def test_ema_on_two_ranks_equals_one_process(kind, extra, vae_path, ema_reference, tmp_path):
    """Each rank averages what it holds of the weights (FSDP's DTensor shards, ZeRO's fp32 fragments, Horovod's
    whole replicas); gathered for the export, the average is the one process's. Validation at the last step
    (the loss, and images generated for held-out captions with the parameters gathered) runs on every rank."""
    ref = ema_reference["ema"]["weights"]
    with pytest.raises(AssertionError):  # the comparison tells the average from the weights it lags
        assert_same(ref, {k: ema_reference["weights"][k] for k in ref})
    val = ["--val_every", "4", "--val_batches", "1"]  # and validation with generation, on every rank, at the end
    args = dalle_args(vae_path, str(tmp_path), 4, steps=4, extra=[*extra, "--ema", "0.9", *val])
    launch(kind, "train_dalle.py", args)
    export = safe_load(str(tmp_path / "dalle" / "dalle.safetensors"))
    assert export["ema"]["decay"] == 0.9
    assert_same(ref, export["ema"]["weights"])
    rows = [json.loads(line) for line in open(tmp_path / "dalle" / "metrics.jsonl") if "val_loss" in line]
    assert [r["step"] for r in rows] == [4] and 0 <= rows[0]["val_heldout_full"] <= rows[0]["val_heldout_shape"] <= 1


@pytest.mark.launchers  # 30-65 s each: make test-launchers
def test_ema_resumes_across_backends(vae_path, ema_reference, tmp_path):
    """A 2-rank DDP checkpoint (the average as whole tensors) resumes under ZeRO-3 (fp32 fragments) and under
    FSDP (DTensor shards): both reach the uninterrupted run's average."""
    args = ["--ema", "0.9", "--keep_n_checkpoints", "5"]
    launch("torchrun", "train_dalle.py", dalle_args(vae_path, str(tmp_path / "ddp"), 4, steps=4, extra=args))
    ref = ema_reference["ema"]["weights"]
    assert_same(ref, safe_load(str(tmp_path / "ddp" / "dalle" / "dalle.safetensors"))["ema"]["weights"])
    for name, extra in (("z3", ["--zero_stage", "3"]), ("fsdp", ["--distributed_backend", "fsdp"])):
        kind = "deepspeed" if name == "z3" else "torchrun"
        restart_from_step_2(tmp_path / "ddp" / "dalle", tmp_path / name / "dalle")
        resumed = [*dalle_args(vae_path, str(tmp_path / name), 4, steps=4, extra=[*args, *extra]), "--resume", "auto"]
        out = launch(kind, "train_dalle.py", resumed)
        assert "step-00000002 at step 2" in out and "holds no EMA" not in out
        assert_same(ref, safe_load(str(tmp_path / name / "dalle" / "dalle.safetensors"))["ema"]["weights"])


def test_streamed_shards_on_two_ranks_resume_on_one(tmp_path, capsys):
    """torchrun, 2 ranks: the shards are counted by both (one collective) and each rank streams its part; stopped
    after step 3, one process takes what the epoch had left (40 of 64 samples: 10 steps) and then a new epoch."""
    import train_vae
    from dalle_pytorch.data.shapes_export import export_wds

    export_wds(str(tmp_path / "shards"), 64, image_size=16, per_shard=9)  # 8 shards, the last of 1
    args = [*TINY_VAE, "--wds", "png", "--image_folder", str(tmp_path / "shards"), "--batch_size", "4",
            "--save_every_n_steps", "3", "--sample_every", "0", "--output_dir", str(tmp_path)]  # fmt: skip
    launch("torchrun", "train_vae.py", [*args, "--steps", "3"])
    run = os.path.join(tmp_path, "vae")
    with open(os.path.join(run, "shards.json")) as f:
        assert sum(json.load(f)["samples"].values()) == 64
    state = load_shared_file(step_dirs(os.path.join(run, "checkpoints"))[0])["state"]
    assert state["samples_in_epoch"] == 24 and state["stream"]["ranks"] == 2
    train_vae.main([*args, "--steps", "16", "--resume", "auto"])
    assert "its 40 samples left go to 1 ranks x 1 workers with batch 4" in capsys.readouterr().out
    with open(os.path.join(run, "metrics.jsonl")) as f:
        epochs = {row["step"]: row["epoch"] for row in map(json.loads, f) if row.get("step", 0) > 3 and "epoch" in row}
    assert [epochs[s] for s in range(4, 17)] == [0] * 10 + [1] * 3
