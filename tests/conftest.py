"""Shared by the tests: the repository and tests/ on sys.path, one torch thread, and a local HTTP server
(127.0.0.1 only) that stands in for the hosts of the predecessor's pretrained files."""

import io
import os
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
sys.path[:0] = [ROOT, TESTS]  # the scripts and packages; the tests' shared helpers from any subfolder
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)


# DeepSpeed variants whose path another variant of the same test covers in `make test` (ZeRO-1 shares ZeRO-2's
# code; ZeRO-3 is the hardest case of recomputation, sharded writes and the EMA; the HTTP shards case of the
# predecessor's DeepSpeed commands reads what the tar case does, and more; ZeRO-2 with accumulation and ZeRO-3
# without stay): 15-24 s each on 2 cores, they run in `make test-all` and keep `make test` under its 30 minutes.
SLOW_VARIANTS = {
    "tests/launchers/test_launchers.py::test_two_ranks_equal_one_process[no-accum-deepspeed-1]",
    "tests/launchers/test_launchers.py::test_two_ranks_equal_one_process[accum2-deepspeed-1]",
    "tests/launchers/test_launchers.py::test_two_ranks_equal_one_process[no-accum-deepspeed-2]",
    # ZeRO-3 without accumulation: test_text_encoder_ranks.py's zero3 runs the same path with the 2024 recipe's model
    "tests/launchers/test_launchers.py::test_two_ranks_equal_one_process[no-accum-deepspeed-3]",
    "tests/launchers/test_launchers.py::test_ema_on_two_ranks_equals_one_process[deepspeed-2]",
    "tests/models/test_checkpointing.py::test_two_ranks_with_recomputation_equal_one_process_without[deepspeed-0]",
    "tests/models/test_checkpointing.py::test_two_ranks_with_recomputation_equal_one_process_without"
    "[deepspeed-2 --global_batch_size 16]",
    "tests/distributed/test_deepspeed_sharded.py::test_every_rank_writes_its_share[2]",
    "tests/compat/test_predecessor_commands.py::test_deepspeed_commands_train_without_fp16[tar]",
    # a straggler named under FSDP and ZeRO-2: their rank figures travel by the same torch.distributed collectives as
    # DDP's (ddp stays; horovod: below), ~51 s
    "tests/launchers/test_stragglers.py::test_a_slowed_rank_is_named_with_its_host_and_why[fsdp]",
    "tests/launchers/test_stragglers.py::test_a_slowed_rank_is_named_with_its_host_and_why[deepspeed-2]",
    # the VQGAN sharded under FSDP: its discriminator and two optimizers sharded are zero3's case, FSDP's wrapping
    # test_launchers' (~23 s)
    "tests/launchers/test_vqgan_ranks.py::test_two_ranks_equal_one_process[fsdp]",
    # LlamaGen's VQ fine-tuned on 2 ranks (~27 s each): the VQTokenizer under ZeRO-3 is
    # test_two_ranks_equal_one_process's zero3, LlamaGen's layout of it the e2e tests'; all four under make test-all
    "tests/launchers/test_vqgan_ranks.py::test_llamagen_vq_fine_tunes_on_two_ranks_as_in_one_process[zero3]",
    "tests/launchers/test_vqgan_ranks.py::test_llamagen_vq_fine_tunes_on_two_ranks_as_in_one_process[ddp]",
    "tests/launchers/test_vqgan_ranks.py::test_llamagen_vq_fine_tunes_on_two_ranks_as_in_one_process[fsdp]",
    # the fresh-clone suite took 33m30s at 1aa83fe on this session's machine (AMD EPYC, 2 cores): ~3 minutes of
    # checks another default test makes move to make test-all:
    # Ray on one host with accumulation (42 s): tests/cluster/test_ray.py's two workers on two hosts equal 1 process
    "tests/launchers/test_launchers.py::test_two_ranks_equal_one_process[accum2-ray-2]",
    # EMA resumed across backends (41 s): test_resume_across_backends_and_world_sizes (the weights' resharding)
    # and test_ema_on_two_ranks_equals_one_process (the EMA under each backend)
    "tests/launchers/test_launchers.py::test_ema_resumes_across_backends",
    # the JSON's ZeRO stage under the launcher (33 s): test_deepspeed_zero_stage.py's in-process test runs, exports
    # and checkpoints it as ZeRO-3; test_deepspeed_checkpoint_resumes_anywhere resumes DeepSpeed under the launcher
    "tests/launchers/test_launchers.py::test_deepspeed_json_stage_with_zero_stage_auto",
    # CLIP's gathered negatives under ZeRO-2 (20 s): the same backend all_gather as DDP's, FSDP's and Horovod's
    "tests/models/test_clip.py::test_two_ranks_equal_one_process_at_the_same_global_batch[deepspeed-2]",
    # a straggler under horovodrun (21 s): the rule is DDP's, its figures through Horovod's allgather as the
    # launchers' EMA and checkpoint tests use it
    "tests/launchers/test_stragglers.py::test_a_slowed_rank_is_named_with_its_host_and_why[horovod]",
    # the dVAE under deepspeed (17 s): the VQGAN under ZeRO-3 (test_vqgan_ranks.py) runs train_vae.py there
    "tests/launchers/test_launchers.py::test_train_vae_under_launcher[deepspeed]",
    "tests/launchers/test_vqgan_ranks.py::test_llamagen_vq_fine_tunes_on_two_ranks_as_in_one_process[horovod]",
}


def pytest_collection_modifyitems(config, items):
    """Every test under tests/launchers/ starts a real launcher; elsewhere such tests say so themselves. The
    SLOW_VARIANTS are marked slow."""
    launchers = os.path.join(TESTS, "launchers") + os.sep
    for item in items:
        if str(item.path).startswith(launchers):
            item.add_marker(pytest.mark.launcher)
        if item.nodeid in SLOW_VARIANTS:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _own_shard_cache(tmp_path_factory, monkeypatch):
    """Each test's remote shards in a cache folder of its own (a port reused by another test's server is another
    test's shards under the same URL)."""
    monkeypatch.setenv("DALLE_SHARD_CACHE", str(tmp_path_factory.mktemp("shard-cache")))


class Handler(BaseHTTPRequestHandler):
    """Serves server.files by name, with `Range: bytes=N-` unless server.ignore_range; logs every GET."""

    timeout = 10  # a client that stops reading cannot hold a handler thread for longer

    def do_GET(self):
        srv = self.server
        name, wanted = self.path.lstrip("/"), self.headers.get("Range")
        srv.log.append((name, wanted))
        data = srv.files.get(name)
        if data is None:
            self.send_error(404)
            return
        start = int(re.match(r"bytes=(\d+)-$", wanted).group(1)) if wanted and not srv.ignore_range else 0
        if start >= len(data) > 0:
            self.send_error(416)
            return
        self.send_response(206 if wanted and not srv.ignore_range else 200)
        if wanted and not srv.ignore_range:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        body = data[start:]
        if srv.cut_at is not None:  # the connection drops: a short body, then EOF
            body, srv.cut_at = body[: srv.cut_at], None
        for i in range(0, len(body), 50_000):
            self.wfile.write(body[i : i + 50_000])
            srv.sent += len(body[i : i + 50_000])
            time.sleep(srv.delay)

    def log_message(self, *args):
        pass


@pytest.fixture
def server(tmp_path, monkeypatch):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.files, srv.log, srv.sent, srv.ignore_range, srv.cut_at, srv.delay = {}, [], 0, False, None, 0
    srv.daemon_threads = True
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    monkeypatch.setenv("DALLE_PYTORCH_URL_BASE", f"http://127.0.0.1:{srv.server_address[1]}")
    monkeypatch.setenv("DALLE_CACHE", str(tmp_path / "cache"))
    from dalle_pytorch.compat import downloads

    monkeypatch.setattr(downloads, "PREDECESSOR_CACHE", str(tmp_path / "predecessor"))
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(timeout=5)


def _bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.fixture
def pretrained_server(server):
    """The predecessor's four default files, tiny: an OpenAI dVAE and a VQGAN of 16px images."""
    import yaml
    from pretrained_refs import VQGAN_DDCONFIG, random_weights, shapes_of

    from dalle_pytorch.models.openai_dvae import OpenAIDiscreteVAE, OpenAIDVAEConfig
    from dalle_pytorch.models.vqgan import VQGAN, VQGANConfig

    vae = OpenAIDiscreteVAE(OpenAIDVAEConfig(n_hid=16, n_blk_per_group=1, vocab_size=64, n_init=8), 16)
    dd = {**VQGAN_DDCONFIG, "resolution": 16, "attn_resolutions": [8]}
    vqgan = VQGAN(VQGANConfig(**{k: v for k, v in dd.items() if k != "dropout"}, n_embed=32, embed_dim=32))
    params = {"embed_dim": 32, "n_embed": 32, "ddconfig": dd}
    config = {"model": {"target": "taming.models.vqgan.VQModel", "params": params}}
    server.files.update(
        {
            "encoder.pkl": _bytes(vae.enc),  # whole pickled modules, as OpenAI released them
            "decoder.pkl": _bytes(vae.dec),
            "vqgan.1024.model.ckpt": _bytes({"state_dict": random_weights(shapes_of(vqgan), 0)}),
            "vqgan.1024.config.yml": yaml.safe_dump(config).encode(),
        }
    )
    return server


# The launcher tests' shared runs (tests/launch.py): a tiny VAE, and 1 process with the whole batch
@pytest.fixture(scope="module")
def vae_path(tmp_path_factory):
    from launch import TINY_VAE

    import train_vae

    return train_vae.main(
        [*TINY_VAE, "--batch_size", "8", "--steps", "2", "--output_dir", str(tmp_path_factory.mktemp("vae"))]
    )


@pytest.fixture(scope="module")
def reference(vae_path, tmp_path_factory):
    """1 process with the whole batch: 8 per step, and 16 per step for the accumulation runs."""
    from launch import dalle_args, grad_norms

    import train_dalle
    from dalle_pytorch.files import safe_load

    out = {}
    for batch in (8, 16):
        path = str(tmp_path_factory.mktemp(f"ref{batch}"))
        weights = safe_load(train_dalle.main(dalle_args(vae_path, path, batch)))["weights"]
        out[batch] = (weights, grad_norms(os.path.join(path, "dalle")))
    return out


# FID's feature extractors with fixed random values (no weights can be downloaded here), built by bench/fid.py:
# tests/eval/test_fidelity.py checks the project's figures against torch-fidelity's own command with these files
def _bench_fid():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_fid", os.path.join(ROOT, "bench", "fid.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def inception(tmp_path_factory):
    return _bench_fid().random_inception(str(tmp_path_factory.mktemp("inception") / "inception-random.pth"))


@pytest.fixture(scope="session")
def vgg16(tmp_path_factory):
    return _bench_fid().random_vgg16(str(tmp_path_factory.mktemp("vgg16") / "vgg16-random.pth"))


@pytest.fixture(scope="module")
def exports(vae_path, tmp_path_factory):
    """A tiny trained DALLE and a CLIP that reranks for it (the service's and the evaluation's tests)."""
    from helpers import ONE_THREAD
    from launch import dalle_args

    import train_clip
    import train_dalle

    out = str(tmp_path_factory.mktemp("exports"))
    dalle = train_dalle.main(dalle_args(vae_path, out, 8, steps=4))
    tiny = ["--dim_text", "32", "--dim_image", "32", "--dim_latent", "32", "--heads", "2", "--patch_size", "4"]
    clip_args = ["--dalle_path", dalle, *tiny, *ONE_THREAD, "--num_workers", "0", "--quiet", "--dataset_size", "64"]
    clip = train_clip.main([*clip_args, "--steps", "2", "--batch_size", "8", "--output_dir", out])
    return dalle, clip
