"""Benchmarks: MFU of Megatron training steps (:mod:`.mfu`); command line in :mod:`.cli`."""
