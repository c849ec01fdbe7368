"""A task base is the same, bit for bit, whatever thread count the process that builds it
runs with: a world-1 run builds on one torch thread per core, a rank of a torchrun launch of
two or more on one (OMP_NUM_THREADS=1)."""

import hashlib

import torch

from megatron_rl.tasks.base_model import BaseModelSettings, make_tiny_base

# Four warm-up steps of four examples are enough: built on the caller's threads, the MoE
# experts' grouped GEMM already rounded differently on 1 and 2 threads.
SETTINGS = BaseModelSettings(num_train_prompts=200, num_eval_prompts=8, warmup_steps=4, warmup_batch_size=4)


def test_the_weights_do_not_depend_on_the_callers_thread_count(tmp_path):
    caller = torch.get_num_threads()
    digests, reported = [], []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            reported.append(make_tiny_base(tmp_path / str(threads), SETTINGS, verbose=False)["torch_threads"])
            assert torch.get_num_threads() == threads  # the caller's count is restored
            weights = (tmp_path / str(threads) / "model.safetensors").read_bytes()
            digests.append(hashlib.sha256(weights).hexdigest())
    finally:
        torch.set_num_threads(caller)
    assert digests[0] == digests[1]  # the saved weights, bit for bit
    assert reported[0] == reported[1]
