"""The lab beside the runtime: what measures megatron_rl rather than what runs it.

`megatron_rl` is what a training job imports. This package holds the tools that study it:
the benchmarks behind `megatron-rl bench`, the monitor's synthetic traces and evaluation
behind `megatron-rl monitor eval|synth`, and the helpers the test suite builds tiny models
and launches with. It may import the runtime; the runtime never imports it (a test walks the
import graph to keep it so), and it reaches the command line through the entry-point group
`megatron_rl.commands` (megatron_rl_lab.commands).
"""
