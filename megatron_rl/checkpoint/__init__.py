"""ByteCheckpoint-style checkpoints for Megatron-Core (on-disk layout: format.py; docs/design.md).

Data and metadata apart, parallelism-free tensor names, replicated chunks written once by a
balanced choice of writer, async save that blocks only for the host copy (or, deferred, only
an optimizer update that comes before the copy is done), atomic commit,
and loading into any TP/PP/EP/ETP/DP layout (distributed optimizer included).
A :class:`Checkpointer` keeps what one save reuses for the next (plans, host buffers, the
saves in flight); its owner (the trainer, a tool) makes one and closes it::

    with Checkpointer() as ckpt:
        h = ckpt.save(root, step, model=chunks, optimizer=opt, extra={...}, async_save=True)
        extra = ckpt.load(root, model=chunks, optimizer=opt)           # newest committed step
    for name, tensor in iter_model_tensors(root): ...                  # one process, for export
"""

from megatron_rl.checkpoint.format import CheckpointError, committed_steps, latest_step
from megatron_rl.checkpoint.store import SNAPSHOTS, Checkpointer, iter_model_tensors, layout_of
from megatron_rl.checkpoint.writer import SaveHandle

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "SNAPSHOTS",
    "SaveHandle",
    "committed_steps",
    "iter_model_tensors",
    "latest_step",
    "layout_of",
]
