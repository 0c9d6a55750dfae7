"""--mlflow [TRACKING_URI]: the run in an MLflow tracking server (or a local store), written by rank 0.

The run's config is logged as parameters (`train.learning_rate`, `model.dim`, ...) once it is whole (at the first
metrics: DALLE's vocabulary sizes are known only after the tokenizer), the metrics of every log step with each
rank's figures (`rank1/step_ms`), the sample grids under `samples/`, and the export under `export/` when the run
ends (finished, or stopped by SIGTERM: uploading a large export at every checkpoint would hold every rank up). The
MLflow run's id is kept in the run directory (mlflow_run_id), so `--resume auto` (or a worker that an elastic run
made rank 0) goes on in the same MLflow run. Through MlflowClient, with the run id passed each time: no
process-global "active run", which Ray's worker thread or a user's own MLflow use could disturb.

A server that does not answer at start stops the run in one line; one that fails later costs one warning, and the
run goes on without MLflow (the trackers' guard, trackers/__init__.py): the run directory has everything.
"""

from __future__ import annotations

import math
import os
import time

from . import read_run_id

RUN_ID_FILE = "mlflow_run_id"
DEFAULT_URI = "env"  # --mlflow alone: MLFLOW_TRACKING_URI, else MLflow's default store
# MLflow's client retries a request 7 times (minutes) by default; the other ranks wait in a collective meanwhile
RETRIES, TIMEOUT_S = "2", "20"


class MLflowRun:
    @classmethod
    def from_config(cls, cfg, run_path: str, continue_run: bool, say):
        if not cfg.mlflow:
            return None
        return cls(run_path, cfg.mlflow, cfg.mlflow_experiment, continue_run, say)

    def __init__(self, run_path: str, uri: str, experiment: str, continue_run: bool, say=print):
        try:
            from mlflow import MlflowClient
            from mlflow.exceptions import MlflowException
        except ImportError:
            raise ImportError("--mlflow needs the mlflow package: run `make install` (or pip install mlflow)") from None
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", RETRIES)
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", TIMEOUT_S)
        self._say = say
        self._client = MlflowClient(None if uri == DEFAULT_URI else uri)
        self.uri = self._client.tracking_uri
        self.label = f"MLflow at {self.uri}"
        _probe(self.uri)
        id_file = os.path.join(run_path, RUN_ID_FILE)
        previous = read_run_id(id_file) if continue_run else None
        try:
            self.run_id, self._logged = None, set()
            if previous:
                try:
                    self._logged = set(self._client.get_run(previous).data.params)
                    self._client.update_run(previous, status="RUNNING")
                    self.run_id = previous
                except MlflowException as e:
                    if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                        raise
                    say(f"MLflow at {self.uri} has no run {previous} (recorded in {id_file}): starting a new one")
            if self.run_id is None:
                found = self._client.get_experiment_by_name(experiment)
                exp_id = found.experiment_id if found else self._client.create_experiment(experiment)
                self.run_id = self._client.create_run(exp_id, run_name=os.path.basename(run_path)).info.run_id
        except MlflowException as e:  # the server answers and refuses (permissions, a bad store): one line
            raise ValueError(f"--mlflow {uri}: MLflow refused ({e.error_code}: {_first_line(e)})") from None
        except Exception as e:  # noqa: BLE001 - a server that stopped answering after the probe: one line
            raise ConnectionError(
                f"--mlflow {uri}: the tracking server did not answer ({type(e).__name__}: {_first_line(e)}); start it "
                "(mlflow server --backend-store-uri sqlite:///mlflow.db), fix the URI, or drop --mlflow"
            ) from None
        with open(id_file, "w") as f:
            f.write(self.run_id)
        self._params_pending: dict | None = None
        self._export: str | None = None

    def set_config(self, config: dict) -> None:
        """The run's config (config.json's dict); logged as parameters with the first metrics."""
        self._params_pending = config

    def log_metrics(self, step: int, row: dict) -> None:
        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        metrics = [
            Metric(k, float(v), ms, step)
            for k, v in row.items()
            if k not in ("step", "time") and isinstance(v, (int, float)) and math.isfinite(v)
        ]

        self._log_params()
        for i in range(0, len(metrics), 1000):  # the REST API takes at most 1000 metrics per batch
            self._client.log_batch(self.run_id, metrics=metrics[i : i + 1000], synchronous=True)

    def log_image(self, step: int, key: str, path: str) -> None:
        self._client.log_artifact(self.run_id, path, key)

    def log_artifact(self, path: str) -> None:
        """The export, uploaded under export/ when the run ends (it is rewritten at every checkpoint)."""
        self._export = path

    def close(self, status: str) -> None:
        """FINISHED, FAILED, or KILLED (SIGTERM: saved, to be resumed)."""
        if status != "FAILED" and self._export and os.path.exists(self._export):
            self._client.log_artifact(self.run_id, self._export, "export")
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


def absolute_uri(uri: str) -> str:
    """`uri` as the launching process resolves it (--mlflow alone: its MLFLOW_TRACKING_URI or MLflow's default
    store; a relative local store: from its working directory), for workers that run elsewhere (Ray)."""
    if uri == DEFAULT_URI:
        from mlflow import get_tracking_uri

        uri = get_tracking_uri()
    for scheme in ("sqlite:///", "file://"):
        if uri.startswith(scheme) and not uri[len(scheme) :].startswith("/"):
            return scheme + os.path.abspath(uri[len(scheme) :])
    return uri if "://" in uri or uri.startswith("databricks") else os.path.abspath(uri)


def _probe(uri: str) -> None:
    """An HTTP server that does not answer is said at once (MLflow's client would retry for minutes)."""
    if not uri.startswith(("http://", "https://")):
        return
    import ssl
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=10).close()
    except urllib.error.HTTPError:
        return  # it answers (a proxy or an auth layer may refuse /health): the run's requests will tell
    except OSError as e:
        if isinstance(getattr(e, "reason", e), ssl.SSLError):
            return  # it answers, over TLS that MLflow's client may trust (MLFLOW_TRACKING_SERVER_CERT_PATH, ...)
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


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]
