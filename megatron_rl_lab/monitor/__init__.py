"""The monitor's lab: synthetic traces with labelled faults and the evaluation that scores
the detector (megatron_rl.monitor) on them.

  synth, distractors, stepsynth   the first generator: per-metric signals with faults
  coupled                         a second, independent one: a synchronous job simulated
                                  step by step, sensors rendered from it
  evaluate, baseline              precision/recall/F1, false alarms, delay, call time, for
                                  the detector and two baselines
  replay                          drives the real OnlineMonitor from a recorded grid
  cli                             `monitor eval | synth | train-synthetic` (entry points)
"""
