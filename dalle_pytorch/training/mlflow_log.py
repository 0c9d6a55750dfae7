"""--mlflow [TRACKING_URI]: the run in an MLflow tracking server (or a local store), written by rank 0.

The run's config is logged as parameters (`train.learning_rate`, `model.dim`, ...) once it is whole (at the first
metrics: DALLE's vocabulary sizes are known only after the tokenizer), the metrics of every log step with each
rank's figures (`rank1/step_ms`), the sample grids under `samples/` and the export under `export/`. The MLflow run's
id is kept in the run directory (mlflow_run_id), so `--resume auto` (or a worker that an elastic run made rank 0)
goes on in the same MLflow run. Through MlflowClient, with the run id passed each time: no process-global
"active run", which Ray's worker thread or a user's own MLflow use could disturb.
"""

from __future__ import annotations

import math
import os
import time

RUN_ID_FILE = "mlflow_run_id"
DEFAULT_URI = "env"  # --mlflow alone: MLFLOW_TRACKING_URI, else MLflow's default store


class MLflowRun:
    def __init__(self, run_path: str, uri: str, experiment: str, continue_run: bool):
        try:
            from mlflow import MlflowClient
        except ImportError:
            raise ImportError("--mlflow needs the mlflow package: run `make install` (or pip install mlflow)") from None
        self._client = MlflowClient(None if uri == DEFAULT_URI else uri)
        _probe(self._client.tracking_uri)
        id_file = os.path.join(run_path, RUN_ID_FILE)
        previous = _read(id_file) if continue_run else None
        try:
            if previous:
                self.run_id = previous
                self._client.update_run(previous, status="RUNNING")
                self._logged = set(self._client.get_run(previous).data.params)
            else:
                found = self._client.get_experiment_by_name(experiment)
                exp_id = found.experiment_id if found else self._client.create_experiment(experiment)
                self.run_id = self._client.create_run(exp_id, run_name=os.path.basename(run_path)).info.run_id
                self._logged = set()
        except Exception as e:  # noqa: BLE001 - a server that is down or refuses: one line, before training
            raise ConnectionError(
                f"--mlflow {uri}: the tracking server did not answer ({type(e).__name__}: {_first_line(e)}); start it "
                "(mlflow server --backend-store-uri sqlite:///mlflow.db), fix the URI, or drop --mlflow"
            ) from e
        with open(id_file, "w") as f:
            f.write(self.run_id)
        self.uri = self._client.tracking_uri
        self._params_pending: dict | None = None

    def set_config(self, config: dict) -> None:
        """The run's config (config.json's dict); logged as parameters with the first metrics."""
        self._params_pending = config

    def log_metrics(self, step: int, row: dict) -> None:
        from mlflow.entities import Metric

        self._log_params()
        ms = int(time.time() * 1000)
        metrics = [
            Metric(k, float(v), ms, step)
            for k, v in row.items()
            if k not in ("step", "time") and isinstance(v, (int, float)) and math.isfinite(v)
        ]
        for i in range(0, len(metrics), 1000):  # the REST API takes at most 1000 metrics per batch
            self._client.log_batch(self.run_id, metrics=metrics[i : i + 1000], synchronous=True)

    def log_artifact(self, path: str, folder: str) -> None:
        self._client.log_artifact(self.run_id, path, folder)

    def close(self, status: str) -> None:
        """FINISHED, FAILED, or KILLED (SIGTERM: saved, to be resumed)."""
        self._log_params()
        self._client.set_terminated(self.run_id, status)

    def _log_params(self) -> None:
        """The config's leaves as parameters; a resumed run logs only those it did not have (MLflow's parameters
        cannot change, and a relaunch differs in --resume at least)."""
        if self._params_pending is None:
            return
        from mlflow.entities import Param

        params = [Param(k, _value(v)) for k, v in _flat(self._params_pending).items() if k not in self._logged]
        self._client.log_batch(self.run_id, params=params, synchronous=True)
        self._logged.update(p.key for p in params)
        self._params_pending = None


def _probe(uri: str) -> None:
    """An HTTP server that does not answer is said at once (MLflow's client would retry for minutes)."""
    if not uri.startswith(("http://", "https://")):
        return
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=10).close()
    except urllib.error.HTTPError:
        return  # it answers (a proxy or an auth layer may refuse /health): the run's requests will tell
    except OSError as e:
        raise ConnectionError(
            f"--mlflow {uri}: nothing answers there ({getattr(e, 'reason', e)}); start the tracking server "
            "(mlflow server --backend-store-uri sqlite:///mlflow.db --port 5000), fix the URI, or drop --mlflow"
        ) from None


def _flat(config: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _value(v) -> str:
    return str(v)[:6000]  # MLflow's limit on a parameter's value


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]
