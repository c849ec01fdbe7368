"""The store on plain tensors, one process: resharding reads, async snapshot, atomic commit,
checksums, retention, confined paths, the inspect CLI, and a writer killed mid-write."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from megatron_rl.checkpoint import Checkpointer, cli, iter_model_tensors, latest_step, writer
from megatron_rl.checkpoint import format as fmt
from megatron_rl.checkpoint.items import Item
from megatron_rl.checkpoint.reader import Reader

HEADER = {"extra": {"data_position": 17}, "layout": {"world_size": 1}}
RECORD = {"rng": None, "optimizer": None}


def _items(full, rows):
    """``full`` cut into row blocks [(start, stop), ...] as items of tensor 'w'."""
    return [Item("w", tuple(full.shape), (a, 0), full[a:b]) for a, b in rows]


@pytest.fixture
def ckpt():
    with Checkpointer() as checkpointer:
        yield checkpointer


def _save(ckpt, root, step, items, **kw):
    return ckpt.save_items(root, step, items, HEADER, RECORD, **kw)


def _read(root, step, name, offsets, out):
    meta = fmt.read_metadata(root, step)
    with Reader(fmt.step_dir(root, step), meta) as reader:
        reader.fill([Item(name, tuple(meta.tensors[name].shape), offsets, out)])
    return out


def test_saved_row_blocks_load_into_any_box(tmp_path, ckpt):
    full = torch.randn(10, 6)
    _save(ckpt, tmp_path, 1, _items(full, [(0, 4), (4, 10)]) + [Item("b", (3,), (0,), torch.arange(3.0))]).wait()
    assert _read(tmp_path, 1, "w", (2, 1), torch.zeros(5, 4)).equal(full[2:7, 1:5])
    assert _read(tmp_path, 1, "w", (0, 3), torch.zeros(10, 3)).equal(full[:, 3:])
    assert dict(iter_model_tensors(tmp_path))["w"].equal(full)
    assert fmt.read_metadata(tmp_path, 1).extra == {"data_position": 17}


def test_bf16_and_replicated_chunks_written_once(tmp_path, ckpt):
    full = torch.randn(4, 4).to(torch.bfloat16)
    _save(ckpt, tmp_path, 1, _items(full, [(0, 4), (0, 4)])).wait()
    entry = fmt.read_metadata(tmp_path, 1).tensors["w"]
    assert entry.dtype == "bfloat16" and len(entry.chunks) == 1
    assert _read(tmp_path, 1, "w", (1, 0), torch.zeros(2, 4, dtype=torch.bfloat16)).equal(full[1:3])


def test_async_save_keeps_the_values_at_save_time(tmp_path, ckpt):
    full = torch.randn(64, 64)
    before = full.clone()
    handle = _save(ckpt, tmp_path, 1, _items(full, [(0, 64)]), async_save=True)
    full.add_(1.0)  # training goes on while the background thread writes
    handle.wait()
    assert dict(iter_model_tensors(tmp_path))["w"].equal(before)


def test_async_saves_reuse_host_buffers_and_follow_a_new_layout(tmp_path, ckpt):
    full = torch.randn(64, 64)
    items = _items(full, [(0, 32), (32, 64)])
    _save(ckpt, tmp_path, 1, items, async_save=True).wait()
    buffers = ckpt._buffers[str(tmp_path.absolute())]
    first = {key: buffer.data_ptr() for key, buffer in buffers._buffers.items()}
    full.add_(1.0)
    _save(ckpt, tmp_path, 2, items, async_save=True).wait()
    # the steady state copies into the same (already mapped) host memory
    assert {key: buffer.data_ptr() for key, buffer in buffers._buffers.items()} == first
    assert dict(iter_model_tensors(tmp_path))["w"].equal(full)
    full.add_(1.0)
    _save(ckpt, tmp_path, 3, _items(full, [(0, 16), (16, 64)]), async_save=True).wait()  # the list changed
    assert len(fmt.read_metadata(tmp_path, 3).tensors["w"].chunks) == 2
    assert dict(iter_model_tensors(tmp_path))["w"].equal(full)


def _hold_writer(ckpt, seconds):
    """Keep the checkpointer's background writer busy for ``seconds``: the next save's job starts after."""
    started = threading.Event()
    ckpt._background().submit(lambda: (started.set(), time.sleep(seconds)))
    started.wait()


def test_deferred_snapshot_holds_the_optimizer_update_until_copied(tmp_path, ckpt):
    weight = torch.nn.Parameter(torch.randn(64, 64))
    before = weight.detach().clone()
    opt = torch.optim.SGD([weight], lr=1.0)
    weight.grad = torch.ones_like(weight)
    _hold_writer(ckpt, 0.5)
    waited_before = ckpt.snapshot_wait_seconds()
    start = time.perf_counter()
    handle = _save(
        ckpt,
        tmp_path,
        1,
        _items(weight.detach(), [(0, 32), (32, 64)]),
        async_save=True,
        snapshot="before_update",
        guard=[opt],
    )
    returned = time.perf_counter() - start
    opt.step()  # the update must not run before the background thread has copied the weights
    waited = ckpt.snapshot_wait_seconds() - waited_before
    handle.wait()
    assert returned < 0.25 and waited > 0.25, (returned, waited)  # the save did not copy; the update waited
    assert dict(iter_model_tensors(tmp_path))["w"].equal(before)
    assert weight.detach().equal(before - 1.0)
    # An update after the copy does not wait at all.
    _save(
        ckpt, tmp_path, 2, _items(weight.detach(), [(0, 64)]), async_save=True, snapshot="before_update", guard=[opt]
    ).wait()
    waited_before = ckpt.snapshot_wait_seconds()
    opt.step()
    assert ckpt.snapshot_wait_seconds() == waited_before
    assert dict(iter_model_tensors(tmp_path))["w"].equal(before - 1.0)


def test_deferred_snapshot_guards_only_the_optimizer(tmp_path, ckpt):
    """The contract, shown by breaking it: an in-place write that bypasses the optimizer and
    wait_snapshot() lands in the checkpoint; with wait_snapshot() first it does not."""
    full = torch.zeros(16, 16)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    _hold_writer(ckpt, 0.3)
    handle = _save(ckpt, tmp_path, 1, _items(full, [(0, 16)]), async_save=True, snapshot="before_update", guard=[opt])
    full.add_(1.0)
    handle.wait()
    assert dict(iter_model_tensors(tmp_path))["w"].equal(full)  # the write raced ahead of the copy
    _hold_writer(ckpt, 0.3)
    handle = _save(ckpt, tmp_path, 2, _items(full, [(0, 16)]), async_save=True, snapshot="before_update", guard=[opt])
    assert ckpt.wait_snapshot() > 0.1
    full.add_(1.0)
    handle.wait()
    assert dict(iter_model_tensors(tmp_path))["w"].equal(full - 1.0)


def test_deferred_saves_queue_without_waiting_for_each_other(tmp_path, ckpt):
    """Critic and actor saved back to back (two roots), then a second step of one root: no
    call waits for an earlier save's write; each optimizer waits only for its own copy."""
    critic_w, actor_w = torch.nn.Parameter(torch.randn(32, 8)), torch.nn.Parameter(torch.randn(16, 8))
    critic_before, actor_before = critic_w.detach().clone(), actor_w.detach().clone()
    critic_opt, actor_opt = torch.optim.SGD([critic_w], lr=1.0), torch.optim.SGD([actor_w], lr=1.0)
    critic_w.grad, actor_w.grad = torch.ones_like(critic_w), torch.ones_like(actor_w)
    deferred = dict(async_save=True, snapshot="before_update")
    _hold_writer(ckpt, 0.4)
    start = time.perf_counter()
    critic = _save(ckpt, tmp_path / "critic", 1, _items(critic_w.detach(), [(0, 32)]), guard=[critic_opt], **deferred)
    _actor = _save(ckpt, tmp_path / "actor", 1, _items(actor_w.detach(), [(0, 16)]), guard=[actor_opt], **deferred)
    assert time.perf_counter() - start < 0.2  # the actor's save did not wait for the critic's write
    assert not critic.done()
    critic_opt.step()  # waits for the critic's copy (behind the held writer), not for the actor's
    actor_opt.step()
    ckpt.wait_pending()
    assert dict(iter_model_tensors(tmp_path / "critic"))["w"].equal(critic_before)
    assert dict(iter_model_tensors(tmp_path / "actor"))["w"].equal(actor_before)
    # Two steps of one root queued: both commit, in order, each with its own values.
    _hold_writer(ckpt, 0.2)
    _save(ckpt, tmp_path / "actor", 2, _items(actor_w.detach(), [(0, 16)]), guard=[actor_opt], keep_last=2, **deferred)
    actor_opt.step()
    _save(ckpt, tmp_path / "actor", 3, _items(actor_w.detach(), [(0, 16)]), guard=[actor_opt], keep_last=2, **deferred)
    ckpt.wait_pending()
    assert fmt.committed_steps(tmp_path / "actor") == [2, 3]
    assert dict(iter_model_tensors(tmp_path / "actor", 2))["w"].equal(actor_before - 1.0)
    assert dict(iter_model_tensors(tmp_path / "actor", 3))["w"].equal(actor_before - 1.0 - 1.0)


def test_a_failed_deferred_save_is_reported_by_the_next_save(tmp_path, ckpt):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    orphan = Item("optimizer.fp32_param.v", (2,), (0,), torch.ones(2), alias_of="v")
    handle = _save(ckpt, tmp_path, 1, [orphan], async_save=True, snapshot="before_update", guard=[opt])
    while not handle.done():
        time.sleep(0.01)
    deferred = dict(async_save=True, snapshot="before_update", guard=[opt])
    with pytest.raises(fmt.CheckpointError, match="aliases v, which no rank wrote"):
        _save(ckpt, tmp_path, 2, _items(torch.ones(2, 2), [(0, 2)]), **deferred)
    _save(ckpt, tmp_path, 2, _items(torch.ones(2, 2), [(0, 2)]), **deferred).wait()  # reported once; saving goes on
    assert fmt.committed_steps(tmp_path) == [2]


def test_two_checkpointers_share_no_state(tmp_path):
    """Each owns its saves in flight, writer thread, update gate and host buffers: a save of
    one does not queue behind the other's writer, and an update held by one's deferred
    snapshot is not the other's to wait for."""
    weight = torch.nn.Parameter(torch.randn(8, 8))
    before = weight.detach().clone()
    opt = torch.optim.SGD([weight], lr=1.0)
    weight.grad = torch.ones_like(weight)
    with Checkpointer() as first, Checkpointer() as second:
        release = threading.Event()
        first._background().submit(lambda: release.wait(60))  # first's writer is busy until released
        held = _save(
            first,
            tmp_path / "first",
            1,
            _items(weight.detach(), [(0, 8)]),
            async_save=True,
            snapshot="before_update",
            guard=[opt],
        )
        _save(second, tmp_path / "second", 1, _items(torch.ones(4, 4), [(0, 4)]), async_save=True).wait()
        second.wait_pending()
        assert fmt.committed_steps(tmp_path / "second") == [1] and not held.done()
        assert second.wait_snapshot() == 0.0  # first's copy is still to come
        threading.Timer(0.3, release.set).start()
        opt.step()  # held by first's gate until first's writer has copied the weight
        assert first.snapshot_wait_seconds() > 0.1 and second.snapshot_wait_seconds() == 0.0
        assert list(second._buffers) == [str((tmp_path / "second").absolute())]
    assert dict(iter_model_tensors(tmp_path / "first"))["w"].equal(before)  # closing committed it
    assert weight.detach().equal(before - 1.0)


def test_close_commits_the_saves_in_flight_and_ends_the_writer_thread(tmp_path):
    ckpt = Checkpointer()
    _save(ckpt, tmp_path, 1, _items(torch.randn(4, 4), [(0, 4)]), async_save=True)
    writers = {t for t in threading.enumerate() if t.name == "ckpt-writer"}
    ckpt.close()
    assert fmt.committed_steps(tmp_path) == [1]
    assert len(writers - set(threading.enumerate())) == 1
    _save(ckpt, tmp_path, 2, _items(torch.randn(4, 4), [(0, 4)]), async_save=True).wait()  # saves again after close
    ckpt.close()
    assert fmt.committed_steps(tmp_path) == [1, 2]


def test_alias_is_stored_once_and_reads_its_target(tmp_path, ckpt):
    full = torch.randn(6, 4)
    # an optimizer box viewing model rows 1..4, as an fp32 model's main params do
    alias = Item("optimizer.fp32_param.w", (6, 4), (1, 0), full[1:5], alias_of="w")
    _save(ckpt, tmp_path, 1, _items(full, [(0, 3), (3, 6)]) + [alias], async_save=True).wait()
    meta = fmt.read_metadata(tmp_path, 1)
    assert meta.tensors["optimizer.fp32_param.w"].chunks == meta.tensors["w"].chunks
    assert (tmp_path / "step_1" / "data_0.bin").stat().st_size == full.numel() * full.element_size()
    assert _read(tmp_path, 1, "optimizer.fp32_param.w", (1, 0), torch.zeros(4, 4)).equal(full[1:5])
    assert [name for name, _ in iter_model_tensors(tmp_path)] == ["w"]


def test_alias_of_a_tensor_nobody_wrote_fails_the_save(tmp_path, ckpt):
    orphan = Item("optimizer.fp32_param.v", (2,), (0,), torch.ones(2), alias_of="v")
    with pytest.raises(fmt.CheckpointError, match="aliases v, which no rank wrote"):
        _save(ckpt, tmp_path, 1, [orphan], async_save=True).wait()
    assert fmt.committed_steps(tmp_path) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux-only")
def test_background_writer_yields_to_training(tmp_path, ckpt):
    _save(ckpt, tmp_path, 1, _items(torch.randn(4, 4), [(0, 4)]), async_save=True).wait()
    thread = next(t for t in threading.enumerate() if t.name == "ckpt-writer")
    assert os.getpriority(os.PRIO_PROCESS, thread.native_id) >= writer.BACKGROUND_NICE
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < writer.BACKGROUND_NICE


def test_flipped_byte_names_file_and_tensor(tmp_path, ckpt):
    full = torch.randn(8, 8)
    _save(ckpt, tmp_path, 1, _items(full, [(0, 8)])).wait()
    data = tmp_path / "step_1" / "data_0.bin"
    raw = bytearray(data.read_bytes())
    raw[37] ^= 0x10
    data.write_bytes(bytes(raw))
    with pytest.raises(fmt.CheckpointError, match=r"checksum mismatch in .*step_1/data_0\.bin: tensor w"):
        _read(tmp_path, 1, "w", (0, 0), torch.zeros(8, 8))


def test_corrupt_metadata_is_detected(tmp_path, ckpt):
    _save(ckpt, tmp_path, 1, _items(torch.randn(2, 2), [(0, 2)])).wait()
    meta = tmp_path / "step_1" / "metadata.json"
    meta.write_text(meta.read_text().replace('"data_position":17', '"data_position":18'))
    with pytest.raises(fmt.CheckpointError, match="metadata.json: checksum mismatch"):
        fmt.read_metadata(tmp_path, 1)


def test_uncommitted_steps_are_invisible_and_retention_keeps_last(tmp_path, ckpt):
    full = torch.randn(4, 4)
    for step in (1, 2, 3):
        _save(ckpt, tmp_path, step, _items(full + step, [(0, 4)]), keep_last=2).wait()
    assert fmt.committed_steps(tmp_path) == [2, 3] and latest_step(tmp_path) == 3
    (tmp_path / "step_3" / "COMMIT").unlink()  # as if the crash came before the marker
    assert latest_step(tmp_path) == 2
    assert dict(iter_model_tensors(tmp_path))["w"].equal(full + 2)
    with pytest.raises(fmt.CheckpointError, match="nothing does not exist"):
        list(iter_model_tensors(tmp_path / "nothing"))


def test_paths_in_metadata_are_confined(tmp_path):
    meta = fmt.Metadata(
        1, {"w": fmt.TensorEntry("float32", [2], [fmt.Chunk([0], [2], "../../etc/passwd", 0, 8, [0])])}, {}, {}, {}
    )
    with Reader(tmp_path, meta) as reader, pytest.raises(fmt.CheckpointError, match="only data_<rank>.bin"):
        reader.fill([Item("w", (2,), (0,), torch.zeros(2))])


def test_missing_tensor_and_wrong_shape_are_reported(tmp_path, ckpt):
    _save(ckpt, tmp_path, 1, _items(torch.randn(4, 4), [(0, 4)])).wait()
    meta = fmt.read_metadata(tmp_path, 1)
    with Reader(fmt.step_dir(tmp_path, 1), meta) as reader:
        with pytest.raises(fmt.CheckpointError, match="no tensor named v"):
            reader.fill([Item("v", (4, 4), (0, 0), torch.zeros(4, 4))])
        with pytest.raises(fmt.CheckpointError, match=r"tensor w: checkpoint shape \[4, 4\], model shape \[6, 4\]"):
            reader.fill([Item("w", (6, 4), (0, 0), torch.zeros(6, 4))])
        padded = torch.full((6, 4), 7.0)  # a padded-vocab tensor may grow: extra rows are zeroed
        reader.fill([Item("w", (6, 4), (0, 0), padded, allow_shape_mismatch=True)])
        assert padded[4:].eq(0).all() and padded[:4].equal(reader.full_tensor("w"))


def test_bad_arguments_fail_with_a_clear_message(tmp_path, ckpt):
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        ckpt.save(tmp_path, -1, model=[])
    with pytest.raises(ValueError, match="keep_last must be None"):
        ckpt.save(tmp_path, 1, model=[], keep_last=0)
    with pytest.raises(ValueError, match="extra must be a JSON-serialisable dict"):
        ckpt.save(tmp_path, 1, model=[], extra={"x": object()})
    with pytest.raises(ValueError, match=r"snapshot='later' is not one of \['at_save', 'before_update'\]"):
        ckpt.save(tmp_path, 1, model=[], async_save=True, snapshot="later")
    with pytest.raises(ValueError, match="snapshot='before_update' needs async_save=True"):
        ckpt.save(tmp_path, 1, model=[], snapshot="before_update")
    with pytest.raises(ValueError, match="snapshot='before_update' needs the optimizer"):
        ckpt.save(tmp_path, 1, model=[], async_save=True, snapshot="before_update")


def test_inspect_cli(tmp_path, capsys, ckpt):
    _save(ckpt, tmp_path, 5, _items(torch.randn(4, 4), [(0, 2), (2, 4)])).wait()
    (tmp_path / ".tmp_step_6").mkdir()
    assert cli.main(["inspect", str(tmp_path), "--tensors", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "committed steps: [5]" in out and ".tmp_step_6" in out
    assert "w  float32 [4, 4]  2 chunk(s)" in out and "matched its checksums" in out
    assert f"written on: {socket.gethostname()} (ranks 0)" in out  # each rank's host is recorded
    assert fmt.read_metadata(tmp_path, 5).hosts == {"0": socket.gethostname()}
    assert cli.main(["inspect", str(tmp_path / "step_5")]) == 0  # one step directory
    assert "step 5 (" in capsys.readouterr().out


def _inspect_error(capsys, *argv) -> str:
    """The one stderr line of an inspect that must fail with exit 2 and print nothing else."""
    assert cli.main(["inspect", *map(str, argv)]) == cli.BAD_INPUT
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured
    return captured.err


def test_inspect_refuses_what_is_not_a_checkpoint(tmp_path, capsys, ckpt):
    (tmp_path / "empty").mkdir()
    (tmp_path / "pending" / ".tmp_step_3").mkdir(parents=True)  # a save that died before its commit
    (tmp_path / "a_file").write_text("x")
    assert "missing does not exist" in _inspect_error(capsys, tmp_path / "missing")
    assert "a_file is not a directory" in _inspect_error(capsys, tmp_path / "a_file")
    err = _inspect_error(capsys, tmp_path / "empty")
    assert "empty is not a checkpoint: no committed step in it" in err and "COMMIT marker" in err
    assert "unfinished saves: .tmp_step_3" in _inspect_error(capsys, tmp_path / "pending")
    root = tmp_path / "run"
    _save(ckpt, root, 2, _items(torch.randn(2, 2), [(0, 2)])).wait()
    (root / "step_2" / fmt.COMMIT).rename(root / "step_2" / "COMMIT.bak")  # as if the crash came before it
    assert "step_2 has no COMMIT marker" in _inspect_error(capsys, root / "step_2")
    assert "run is not a checkpoint" in _inspect_error(capsys, root)
    (root / "step_2" / "COMMIT.bak").rename(root / "step_2" / fmt.COMMIT)
    assert "step 7 is not a committed checkpoint" in _inspect_error(capsys, root, "--step", 7)
    assert "committed steps: [2]" in _inspect_error(capsys, root, "--step", 7)


KILLED_WRITER = textwrap.dedent("""
    import sys, time, torch
    from pathlib import Path
    from megatron_rl.checkpoint import Checkpointer, writer
    from megatron_rl.checkpoint.items import Item
    root = Path(sys.argv[1])
    header, record = {"extra": {}, "layout": {}}, {"rng": None, "optimizer": None}
    def items(value):
        return [Item(f"t{i}", (256, 1024), (0, 0), torch.full((256, 1024), value)) for i in range(8)]
    ckpt = Checkpointer()
    ckpt.save_items(root, 1, items(1.0), header, record).wait()
    real = writer._as_bytes
    def slow(tensor):  # the writer is mid-file when the parent kills it
        print("WRITING", flush=True)
        time.sleep(0.5)
        return real(tensor)
    writer._as_bytes = slow
    ckpt.save_items(root, 2, items(2.0), header, record, async_save=True).wait()
    print("COMMITTED", flush=True)
""")


def test_sigkill_mid_write_leaves_previous_checkpoint_loadable(tmp_path, ckpt):
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        writes = 0
        for line in proc.stdout:
            writes += line.strip() == "WRITING"
            if writes == 3:  # two chunks of step 2 are in the file, the third is being written
                os.kill(proc.pid, signal.SIGKILL)
                break
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    partial = tmp_path / ".tmp_step_2" / "data_0.bin"
    assert partial.exists() and partial.stat().st_size > 0, "the kill should land mid-write"
    assert fmt.committed_steps(tmp_path) == [1] and latest_step(tmp_path) == 1
    tensors = dict(iter_model_tensors(tmp_path))
    assert len(tensors) == 8 and all(t.eq(1.0).all() for t in tensors.values())
    # saving the same step again discards the dead temporary and commits
    _save(ckpt, tmp_path, 2, [Item("t0", (2,), (0,), torch.ones(2))]).wait()
    assert fmt.committed_steps(tmp_path) == [1, 2] and not (tmp_path / ".tmp_step_2").exists()
