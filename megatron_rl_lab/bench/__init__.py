"""Benchmarks: MFU (:mod:`.plan`, :mod:`.mfu`), weight sync (:mod:`.weight_sync`), checkpoints
(:mod:`.checkpoint`); one model table (:mod:`.presets`); command line in :mod:`.cli`."""
