"""tools/ scripts run a bench through run_bench: its failure reaches the script's caller as
the bench's own exit code and error line, and nothing half-read is returned."""

import pytest

from megatron_rl_lab.bench.subprocess_run import run_bench


def test_a_failed_bench_exits_with_its_code_and_shows_its_error(tmp_path, capsys):
    out = tmp_path / "never.json"
    with pytest.raises(SystemExit) as exited:
        run_bench("packing", ["--rows", 0], out)
    assert exited.value.code == 2  # the bench's bad-argument code
    assert "argument --rows: 0 must be a positive integer" in capsys.readouterr().err
    assert not out.exists()
