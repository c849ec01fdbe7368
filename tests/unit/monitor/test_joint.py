"""The joint GPU score (detect.gpu_joint_scores): three GPU metrics a few spreads off
together, none at the threshold; only on traces without step metrics."""

import numpy as np

from megatron_rl.monitor.denoise import Denoiser, default_model_dir
from megatron_rl.monitor.detect import GPU_JOINT, DetectConfig, detect, gpu_joint_scores, score_grid
from megatron_rl.monitor.tuning import Tuning
from megatron_rl_lab.monitor.coupled import CoupledConfig, generate_coupled

GPU = ["gpu_duty_cycle", "gpu_power", "gpu_tensor_activity"]


def test_the_middle_of_three_gpu_scores_against_the_peers():
    # One window, 10 machines; rows are (duty, power, tensor) scores. Machine 0 has two
    # metrics at 10 (middle 10); machine 9 one metric at 40 (middle 0: one metric alone
    # does not carry it); machine 1 a negative score, counted as 0. The other middles are
    # 0, 1, 1, 2, 2, 3, 3. Middles [10, 0, 0, 1, 1, 2, 2, 3, 3, 0]: median 1.5, absolute
    # deviations' median 1.5, spread 1.4826 * 1.5 = 2.2239.
    z = np.zeros((4, 10, 1), np.float32)  # cpu_util first, then the three GPU metrics
    z[1:, 0, 0] = [10, 10, 0]
    z[1:, 9, 0] = [40, 0, 0]
    z[1:, 1, 0] = [0, -5, 0]
    for i, v in zip(range(2, 9), [0, 1, 1, 2, 2, 3, 3]):
        z[1:, i, 0] = v
    joint = gpu_joint_scores(z, ["cpu_util"] + GPU, min_machines=3)
    spread = 1.4826 * 1.5
    np.testing.assert_allclose(joint[0, 0], 8.5 / spread, rtol=1e-5)
    np.testing.assert_allclose(joint[9, 0], -1.5 / spread, rtol=1e-5)
    np.testing.assert_allclose(joint[1, 0], -1.5 / spread, rtol=1e-5)
    assert gpu_joint_scores(z[:3], ["cpu_util"] + GPU[:2], 3) is None  # needs all three


def test_a_decaying_gpu_without_step_times_is_found_only_by_the_joint_score():
    # Coupled trace, 32 machines: node0009's clock decays by a third from 238 s. Its GPU
    # metrics are each a few spreads off, none long enough above the threshold.
    den = Denoiser.load(default_model_dir())
    st = generate_coupled(CoupledConfig(machines=32, seed=500000, fault="thermal_decay"))
    found = detect(st.grid, DetectConfig(), den).alerts
    assert [(a.machine, a.metric) for a in found] == [(st.labels[0].machine, GPU_JOINT)]
    assert found[0].declared_at > st.labels[0].start
    assert detect(st.grid, DetectConfig(), den, tuning=Tuning(gpu_joint=False)).alerts == []
    healthy = generate_coupled(CoupledConfig(machines=32, seed=500000))  # same job, no fault
    joint = detect(healthy.grid, DetectConfig(), den).alerts
    assert GPU_JOINT not in {a.metric for a in joint}  # (a net_tx_bytes alarm it already had stays)
    assert joint == detect(healthy.grid, DetectConfig(), den, tuning=Tuning(gpu_joint=False)).alerts


def test_no_joint_score_with_step_metrics():
    st = generate_coupled(CoupledConfig(machines=8, seed=3, fault="thermal_decay", step_metrics=True))
    scores = score_grid(st.grid, DetectConfig())
    assert GPU_JOINT not in scores.metrics and scores.z.shape[0] == len(st.grid.metrics)
