"""The lab's `monitor train-synthetic`: the denoiser trained on synthetic fault-free traces."""

from megatron_rl.monitor.cli import main
from megatron_rl.monitor.denoise import Denoiser


def test_train_synthetic_writes_weights_the_detector_loads(tmp_path, capsys):
    argv = ["train-synthetic", "--out", str(tmp_path), "--synthetic", "1", "--machines", "4", "--steps", "2"]
    assert main(argv) == 0
    assert "training on 1 synthetic fault-free traces of 4 machines (seeds 100..100)" in capsys.readouterr().out
    assert Denoiser.load(tmp_path).reconstruct  # loads
