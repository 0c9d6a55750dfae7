"""--ray_workers' refusals, each one line before anything starts (no Ray cluster needed). Ray Train itself runs in
tests/launchers (a local Ray) and tests/cluster/test_ray.py (a 2-node Ray cluster, an elastic run losing a node)."""

import socket

import pytest

import train_dalle


def last_error(argv, capsys, monkeypatch, env=()):
    for k, v in env:
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as e:
        train_dalle.main(["--quiet", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: "), err
    return err[-1]


@pytest.mark.parametrize(
    "argv,env,says",
    [
        (["--ray_workers", "2"], [("TORCHELASTIC_RUN_ID", "x"), ("RANK", "0"), ("WORLD_SIZE", "2")],
         "this process was started by torchrun: run `python "),
        (["--ray_workers", "2"], [("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")], "started by slurm"),
        (["--ray_workers", "2", "--distributed_backend", "horovod"], [], "use horovodrun, or ddp, fsdp or deepspeed"),
        (["--ray_workers", "2", "--distributed_backend", "single"], [], "single runs one process"),
        (["--ray_workers", "1:2"], [], "set --global_batch_size so that every optimizer step sees the same batch"),
        (["--ray_workers", "1:3", "--global_batch_size", "8", "--batch_size", "4"], [],
         "--global_batch_size 8 is not a multiple of --batch_size x world size = 4 x 3"),
        (["--ray_workers", "2", "--global_batch_size", "10", "--batch_size", "4"], [],
         "--global_batch_size 10 is not a multiple of --batch_size x world size = 4 x 2 = 8"),
        (["--ray_workers", "two"], [], "--ray_workers takes N or MIN:MAX (got 'two')"),
        (["--ray_workers", "two", "--zero_stage", "3"], [], "--ray_workers takes N or MIN:MAX (got 'two')"),
        (["--ray_workers", "2", "--zero_stage", "3"], [("TORCHELASTIC_RUN_ID", "x"), ("WORLD_SIZE", "2")],
         "this process was started by torchrun"),
        (["--ray_workers", "3:2"], [], "--ray_workers needs 1 <= MIN <= MAX"),
        (["--ray_workers", "2", "--ray_address", "nowhere"], [], "--ray_address takes HOST:PORT, auto or local"),
        (["--exit_code_on_stop", "300"], [], "--exit_code_on_stop must be an exit status from 0 to 255"),
        (["--ray_workers", "2", "--zero_stage", "3"], [], "--zero_stage is a deepspeed flag, but this run's backend"),
    ],
)  # fmt: skip
def test_refused_in_one_line(argv, env, says, capsys, monkeypatch):
    assert says in last_error(argv, capsys, monkeypatch, env)


def test_no_ray_cluster_at_the_address_is_one_line_at_once(capsys, monkeypatch):
    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    line = last_error(["--ray_workers", "2", "--ray_address", f"127.0.0.1:{port}"], capsys, monkeypatch)
    assert line.startswith(f"error: no Ray cluster at 127.0.0.1:{port} (Connection refused): start one with")
