"""Where a run's scalars go besides metrics.jsonl: TensorBoard, Weights & Biases, MLflow.

`trainer.loggers` names them; TensorBoard is the default (a pinned requirement), wandb and
MLflow are optional installs checked before any model is built. Each writes under the run
dir unless the user's environment says otherwise, so a run on a machine without a network
keeps everything: wandb in offline mode unless WANDB_MODE is set, MLflow in a local file
store (RUN_DIR/mlruns) unless MLFLOW_TRACKING_URI is set. A resumed run continues the same
wandb run and MLflow run (their ids are kept in the run dir).
"""

from __future__ import annotations

import os
import re
import secrets
import time
from pathlib import Path
from typing import Protocol


class ScalarLogger(Protocol):
    """One destination of per-step scalars."""

    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardLogger:
    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    def __init__(self, run_dir: Path, project: str, config: dict):
        import wandb

        id_file = run_dir / "wandb-run-id"
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(
            project=project,
            name=run_dir.name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            config=config,
            mode=os.environ.get("WANDB_MODE", "offline"),
            settings=wandb.Settings(console="off", x_disable_stats=True, quiet=True),
        )

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        import wandb

        self.run.finish()
        wandb.teardown()  # waits for wandb's service to write the run file; finish() alone may return first


MLFLOW_KEY = re.compile(r"[^\w\-. /]")


def mlflow_key(key: str) -> str:
    """MLflow allows letters, digits, `_ - . /` and spaces in a metric name: `val/x/pass@4`
    is logged as `val/x/pass_at_4`."""
    return MLFLOW_KEY.sub("_", key.replace("@", "_at_"))


class MlflowLogger:
    def __init__(self, run_dir: Path, project: str, config: dict):
        import mlflow

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # MLflow 3 keeps its file store behind this switch; a server or sqlite URI needs no switch
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = _file_uri(run_dir)
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        id_file = run_dir / "mlflow-run-id"
        if id_file.exists():
            self.run_id = id_file.read_text().strip()
        else:
            experiment = self.client.get_experiment_by_name(project)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
            self.run_id = self.client.create_run(experiment_id, run_name=run_dir.name).info.run_id
            id_file.write_text(self.run_id + "\n")
            for key, value in _flatten(config).items():
                self.client.log_param(self.run_id, key, value)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(k), float(v), now, step) for k, v in scalars.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _file_uri(run_dir: Path) -> str:
    return (run_dir / "mlruns").resolve().as_uri()


def _flatten(tree: dict, prefix: str = "") -> dict[str, str]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = str(value)[:500]  # MLflow's limit on a parameter's value
    return flat


def open_loggers(names, run_dir: Path, project: str, config: dict) -> list[ScalarLogger]:
    """The loggers ``names`` asks for, opened on rank 0 of a run."""
    run_dir = Path(run_dir)
    built = {
        "tensorboard": lambda: TensorBoardLogger(run_dir),
        "wandb": lambda: WandbLogger(run_dir, project, config),
        "mlflow": lambda: MlflowLogger(run_dir, project, config),
    }
    return [built[name]() for name in names]
