"""--mlflow against a real MLflow tracking server (`mlflow server`, a SQLite store, on loopback, stopped by its
process group), read back with MLflow's client: the config as parameters, the metrics with each rank's, the
sample grids and the export as artifacts, and --resume auto going on in the same MLflow run."""

from __future__ import annotations

import os
import re

import pytest
from helpers import ServerProcess
from launch import BIN, TINY_VAE
from multirank import free_port, on_ranks
from test_loop import FakeTask, config, fit

import train_vae


def start_server(root) -> tuple[str, ServerProcess]:
    """`mlflow server` on a free loopback port with a SQLite store under `root`: (its URI, its process)."""
    uri = f"http://127.0.0.1:{free_port()}"
    argv = [os.path.join(BIN, "mlflow"), "server", "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
            "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1", "--port", uri.rsplit(":", 1)[1],
            "--workers", "1"]  # fmt: skip
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no job runners (7 processes)
    return uri, ServerProcess(argv, root / "server.log", uri + "/health", env=env, cwd=root)


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory):
    uri, server = start_server(tmp_path_factory.mktemp("mlflow"))
    try:
        yield uri
    finally:
        server.stop()


def _runs(uri, experiment):
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    return client, (client.search_runs([found.experiment_id]) if found else [])


@pytest.mark.e2e
def test_a_run_in_mlflow_and_its_resume_in_the_same_mlflow_run(mlflow_uri, tmp_path):
    args = [*TINY_VAE, "--batch_size", "8", "--log_every", "2", "--sample_every", "2", "--save_every_n_steps", "2",
            "--output_dir", str(tmp_path), "--mlflow", mlflow_uri, "--mlflow_experiment", "vae-test"]  # fmt: skip
    train_vae.main([*args, "--steps", "4"])
    client, runs = _runs(mlflow_uri, "vae-test")
    assert len(runs) == 1
    run = runs[0]
    assert run.info.run_name == "vae" and run.info.status == "FINISHED"
    params = run.data.params
    assert params["train.steps"] == "4" and params["model.image_size"] == "16"
    assert params["derived.world_size"] == "1" and params["vae.temp_schedule"] == "cosine"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [2, 4]
    assert {"rank0/step_ms", "rank0/own_ms", "rank0/rss_mb", "temperature", "images_per_s"} <= set(run.data.metrics)
    samples = [a.path for a in client.list_artifacts(run.info.run_id, "samples")]
    assert "samples/step-00000002.png" in samples and "samples/final.png" in samples
    assert [a.path for a in client.list_artifacts(run.info.run_id, "export")] == ["export/vae.safetensors"]
    local = client.download_artifacts(run.info.run_id, "export/vae.safetensors", str(tmp_path / "down"))
    assert open(local, "rb").read() == open(tmp_path / "vae" / "vae.safetensors", "rb").read()

    train_vae.main([*args, "--steps", "6", "--resume", "auto"])
    client, again = _runs(mlflow_uri, "vae-test")
    assert [r.info.run_id for r in again] == [run.info.run_id]  # the same MLflow run, finished again
    assert again[0].info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [2, 4, 6]
    assert again[0].data.params["train.steps"] == "4"  # MLflow's parameters are the first launch's


def _fit_on_rank(rank, out, uri):
    os.environ["MLFLOW_TRACKING_URI"] = uri  # --mlflow alone reads it
    fit(config(out, distributed_backend="ddp", log_every=4, mlflow="env", mlflow_experiment="ranks"),
        FakeTask(os.path.join(out, "fake.pt")))  # fmt: skip


@pytest.mark.e2e
def test_every_ranks_figures_reach_mlflow(mlflow_uri, tmp_path):
    on_ranks(2, _fit_on_rank, str(tmp_path), mlflow_uri)
    client, runs = _runs(mlflow_uri, "ranks")
    assert len(runs) == 1 and runs[0].data.params["derived.world_size"] == "2"
    for name in ("rank0/step_ms", "rank1/step_ms", "rank1/own_ms", "rank1/data_wait_share", "rank1/cpu_percent"):
        assert [m.step for m in client.get_metric_history(runs[0].info.run_id, name)] == [4, 8], name


def test_a_tracking_server_that_does_not_answer_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        train_vae.main([*TINY_VAE, "--steps", "1", "--output_dir", str(tmp_path), "--mlflow",
                        f"http://127.0.0.1:{free_port()}"])  # fmt: skip
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nothing answers there" in err[0] and "drop --mlflow" in err[0], err


STOP_SERVER_HOOK = """
import os
import signal

from dalle_pytorch.training.hooks import Hooks


class StopServer(Hooks):
    def on_log(self, ctx, step, row):  # the tracking server goes away after the first log step
        if step == 2:
            os.killpg(int(os.environ["TEST_MLFLOW_SERVER_PID"]), signal.SIGKILL)
"""


@pytest.mark.e2e
def test_a_server_lost_mid_run_costs_one_warning_and_the_run_goes_on(tmp_path, monkeypatch):
    uri, server = start_server(tmp_path)
    try:
        (tmp_path / "stop.py").write_text(STOP_SERVER_HOOK)
        monkeypatch.setenv("TEST_MLFLOW_SERVER_PID", str(server.proc.pid))
        export = train_vae.main(
            [*TINY_VAE, "--batch_size", "8", "--steps", "6", "--log_every", "2", "--output_dir", str(tmp_path / "runs"),
             "--mlflow", uri, "--hooks", f"{tmp_path / 'stop.py'}:StopServer"]
        )  # fmt: skip
    finally:
        server.stop()
    log = (tmp_path / "runs" / "vae" / "train.log").read_text()
    warnings = [line for line in log.splitlines() if "MLflow" in line]
    assert len(warnings) == 1 and re.search(r"MLflow at \S+ failed on (uploading|the metrics)", warnings[0]), warnings
    assert "the run goes on without MLflow" in warnings[0] and "done at step 6" in log and os.path.exists(export)


@pytest.mark.e2e
def test_a_recorded_run_the_server_does_not_know_starts_a_new_one(mlflow_uri, tmp_path):
    args = [*TINY_VAE, "--batch_size", "8", "--log_every", "2", "--output_dir", str(tmp_path), "--mlflow", mlflow_uri,
            "--mlflow_experiment", "unknown-run"]  # fmt: skip
    train_vae.main([*args, "--steps", "2"])
    (tmp_path / "vae" / "mlflow_run_id").write_text("0" * 32)  # another store's, or a deleted run
    train_vae.main([*args, "--steps", "4", "--resume", "auto"])
    assert f"has no run {'0' * 32}" in (tmp_path / "vae" / "train.log").read_text()
    _, runs = _runs(mlflow_uri, "unknown-run")
    assert len(runs) == 2 and all(r.info.status == "FINISHED" for r in runs)
    assert (tmp_path / "vae" / "mlflow_run_id").read_text() in {r.info.run_id for r in runs}
