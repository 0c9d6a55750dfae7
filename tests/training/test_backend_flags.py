"""A backend's own flags given to a run on another backend stop it in one line (they would do nothing there), and
the run's config.yaml records the options of the backend that ran, no other's."""

import pytest
import yaml
from helpers import ONE_THREAD, TINY_VAE_MODEL

import train_vae

pytestmark = pytest.mark.e2e
TINY = [*TINY_VAE_MODEL, *ONE_THREAD, "--num_workers", "0", "--quiet", "--dataset_size", "32", "--batch_size", "8"]


@pytest.mark.parametrize(
    "flags,says",
    [
        (["--zero_stage", "3"], "--zero_stage is a deepspeed flag, but this run's backend is single: drop it, or "),
        (["--offload_optimizer"], "--offload_optimizer is a deepspeed flag"),
        (["--horovod_compression", "fp16"], "--horovod_compression is a horovod flag, but this run's backend is"),
        (["--commit_every", "5"], "horovodrun -np N python SCRIPT"),
    ],
)
def test_another_backends_flag_is_refused_in_one_line(flags, says, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        train_vae.main([*TINY, "--steps", "1", "--output_dir", str(tmp_path), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].startswith("error: ") and says in err[-1], err


def test_the_record_holds_the_backend_that_ran(tmp_path):
    train_vae.main([*TINY, "--steps", "1", "--output_dir", str(tmp_path), "--sample_every", "0"])
    sections = yaml.safe_load(open(tmp_path / "vae" / "config.yaml"))
    assert "deepspeed" not in sections and "horovod" not in sections and "train" in sections, list(sections)
