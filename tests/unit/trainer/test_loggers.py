"""trainer.loggers for real: what each logger wrote, read back with that tool's own reader."""

import struct

import pytest

from megatron_rl.config.schema import ConfigError
from megatron_rl.from_config import loggers
from megatron_rl.from_config.loggers import check_loggers
from megatron_rl.trainer.loggers import mlflow_key, open_loggers

STEPS = {1: {"reward/mean": 0.25, "val/digits/pass@4": 0.5}, 2: {"reward/mean": 0.5, "val/digits/pass@4": 0.75}}


def _write(run_dir, names, steps):
    (opened,) = open_loggers(names, run_dir, "megatron-rl-test", {"trainer": {"seed": 1}})
    for step in steps:
        opened.log(step, STEPS[step])
    opened.close()


def test_tensorboard_events_hold_every_scalar(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _write(tmp_path, ["tensorboard"], [1, 2])
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    for key in ("reward/mean", "val/digits/pass@4"):
        assert [(e.step, e.value) for e in events.Scalars(key)] == [(s, STEPS[s][key]) for s in (1, 2)]


def test_mlflow_file_store_holds_every_scalar_and_a_resume_continues_the_run(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)

    _write(tmp_path, ["mlflow"], [1])
    _write(tmp_path, ["mlflow"], [2])  # a resumed run: same run id, from the run dir
    client = mlflow.MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    run_id = (tmp_path / "mlflow-run-id").read_text().strip()
    assert client.get_run(run_id).data.params["trainer.seed"] == "1"
    history = client.get_metric_history(run_id, "val/digits/pass_at_4")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.5), (2, 0.75)]


def _wandb_records(path):
    """The protobuf records of an offline run's .wandb file: wandb's 7-byte header, then
    LevelDB's log format (32 KiB blocks of chunks: crc32 u32, length u16, type u8; type 1 is
    a whole record, 2/3/4 its first/middle/last piece). wandb has no Python reader of it."""
    from wandb.proto import wandb_internal_pb2

    data, pos, pending = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == kind == 0:
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_wandb_offline_run_holds_every_scalar(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    _write(tmp_path, ["wandb"], [1, 2])
    (path,) = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    seen = {}
    for record in _wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
            seen[int(items["_step"])] = {k: float(items[k]) for k in STEPS[1] if k in items}
    assert seen == STEPS


def test_mlflow_keys_keep_only_the_characters_it_allows():
    assert mlflow_key("val/digits/pass@4") == "val/digits/pass_at_4"
    assert mlflow_key("timing/eval_s") == "timing/eval_s"


@pytest.mark.parametrize(
    "names, message",
    [
        (
            ["tensorboard", "csv"],
            "trainer.loggers: 'csv' is not a logger; choose from ['mlflow', 'tensorboard', 'wandb']",
        ),
        (["wandb", "wandb"], "trainer.loggers=['wandb', 'wandb'] names a logger twice"),
    ],
)
def test_bad_logger_lists_are_one_line(names, message):
    with pytest.raises(ConfigError) as err:
        check_loggers(names)
    assert str(err.value) == message


def test_a_logger_whose_package_is_missing_names_what_to_install(monkeypatch):
    monkeypatch.setitem(loggers.LOGGERS, "wandb", "wandb_not_installed_here")
    with pytest.raises(ConfigError) as err:
        check_loggers(["wandb"])
    assert str(err.value) == "trainer.loggers: wandb needs `pip install wandb==0.31.0`"
