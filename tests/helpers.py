"""Shared by the tests: the tiny model shapes every end-to-end test trains, and a server process to test against."""

import os
import signal
import subprocess
import time
import urllib.request

TINY_VAE_MODEL = ["--image_size", "16", "--num_tokens", "16", "--hidden_dim", "16", "--codebook_dim", "16"]
TINY_DALLE_MODEL = [
    "--dim",
    "32",
    "--depth",
    "2",
    "--heads",
    "2",
    "--dim_head",
    "16",
    "--text_seq_len",
    "12",
    "--tokenizer",
    "byte",
]

# In-process runs: the trainers' --threads 0 gives each process all its share of the cores, undoing conftest's
# torch.set_num_threads(1); two OpenMP threads on 2 busy cores wait at spinning barriers, measured 10-100x slower
# (a 60-step VAE run: 0.5 s alone, 56 s beside another job). Launched ranks get 1 thread each either way.
ONE_THREAD = ["--threads", "1"]

# Where things are, from any test subfolder
TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
FIXTURES = os.path.join(TESTS, "fixtures")


class ServerProcess:
    """A server (serve.py, `mlflow server`) started in a session of its own, so that its workers share its process
    group; up once GET `health` answers 200. stop() ends the group by the server's pid (never by name)."""

    def __init__(self, argv, log, health, env=None, cwd=None, timeout=120):
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(health, timeout=30) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"{' '.join(argv[:2])} did not start:\n" + open(log).read()[-3000:])
            time.sleep(0.3)

    def stop(self) -> None:
        """SIGTERM to the group, SIGKILL after 20 s; a group already gone (a test killed it) is fine."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=20)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def read_batches(dataset, cfg, backend, pos, say=print):
    """batches() as the loop reads them: each batch, with `pos` (a loop Position) moved to where the data stands."""
    from dalle_pytorch.training.batches import batches

    for batch, where in batches(dataset, cfg, backend, pos.data, say):
        pos.moved_to(where)
        yield batch
