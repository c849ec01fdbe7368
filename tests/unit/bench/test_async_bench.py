"""The async-rollouts benchmark without launching anything: arguments refused in one line with
exit code 2, the launches it would run, and the JSON summary of hand-made metrics rows
against numbers computed by hand."""

import argparse

import pytest

from megatron_rl_lab.bench import async_rollouts as bench
from megatron_rl_lab.bench.args import BenchArgumentError
from megatron_rl_lab.bench.cli import main


def _args(tmp_path, *argv: str) -> argparse.Namespace:
    sub = argparse.ArgumentParser().add_subparsers()
    return bench.add_parser(sub).parse_args(["--dir", str(tmp_path / "runs"), *argv])


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(
        BenchArgumentError, match="launches its own torchrun runs; run it in one process, not WORLD_SIZE=2"
    ):
        bench.make_plan(_args(tmp_path), world=2)
    with pytest.raises(BenchArgumentError, match="--steps 1: the means start at step 2; pass --steps >= 2"):
        bench.make_plan(_args(tmp_path, "--steps", "1"), world=1)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(BenchArgumentError, match="runs exists and is not an empty directory; pass a new or empty one"):
        bench.make_plan(_args(tmp_path), world=1)
    (tmp_path / "runs" / "metrics.jsonl").unlink()
    assert bench.make_plan(_args(tmp_path), world=1).dir == tmp_path / "runs"  # an empty one is taken


def test_a_run_the_trainer_would_refuse_is_refused_before_any_launch(tmp_path):
    """Two training ranks with two mini-batches need 4 rows a step; one group of 2 has 2."""
    args = _args(tmp_path, "--train-ranks", "2", "--prompts-per-step", "1", "--n-samples", "2")
    with pytest.raises(BenchArgumentError, match=r"^colocated \(world 2\): rollout.prompts_per_step=1 groups"):
        bench.make_plan(args, world=1)


def test_bad_arguments_exit_2_with_one_line(tmp_path, capsys):
    assert main(["async", "--steps", "1", "--dir", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-rl bench async: error: --steps 1") and err.count("\n") == 1
    assert main(["async", "--set", "trainer.seq_lenght=112", "--dir", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-rl bench async: error: colocated (world 1): ") and "seq_lenght" in err
    assert err.count("\n") == 1


def test_the_launches(tmp_path):
    plan = bench.make_plan(
        _args(
            tmp_path,
            "--train-ranks",
            "2",
            "--rollout-ranks",
            "2",
            "--steps",
            "5",
            "--task",
            "digits_max_work",
            "--partial-chunk-tokens",
            "3",
            "--set",
            "trainer.seq_length=112",
        ),
        world=1,
    )
    colocated, k0, k1, partial = bench.launches(plan)
    assert [(x.mode, x.world) for x in (colocated, k0, k1, partial)] == [
        ("colocated", 2),
        ("disaggregated_k0", 4),
        ("disaggregated_k1", 4),
        ("disaggregated_k1_partial", 4),
    ]
    assert [x.run_dir for x in (colocated, k0, k1, partial)] == [tmp_path / "runs" / m for m in bench.MODES]
    assert colocated.config_overrides()[0] == f"trainer.run_dir={tmp_path / 'runs' / 'colocated'}"
    common = set(colocated.overrides)
    assert {
        "trainer.max_steps=5",
        "rollout.seed_per_prompt=true",
        "data.source=task:digits_max_work",
        bench.CORRECTION,
    } <= common
    assert colocated.overrides[-1] == "trainer.seq_length=112"  # --set comes after the bench's own
    disaggregated = {"rollout.placement=disaggregated", "rollout.num_ranks=2"}
    for launch, k in ((k0, 0), (k1, 1)):
        assert set(launch.overrides) == common | disaggregated | {f"rollout.max_staleness={k}"}
    assert set(partial.overrides) == common | disaggregated | {
        "rollout.max_staleness=1",
        "rollout.partial=true",
        "rollout.partial_chunk_tokens=3",
    }
    assert k1.command()[3:5] == ["--standalone", "--nproc-per-node=4"]
    assert not (tmp_path / "runs").exists()  # planning creates nothing
    chosen = bench.make_plan(_args(tmp_path, "--modes", "disaggregated_k0,disaggregated_k1_partial"), world=1)
    assert [x.mode for x in bench.launches(chosen)] == ["disaggregated_k0", "disaggregated_k1_partial"]
    with pytest.raises(BenchArgumentError, match="--modes 'k1': choose from colocated, disaggregated_k0"):
        bench.make_plan(_args(tmp_path, "--modes", "k1"), world=1)


def _row(step, tokens_per_s, step_s, reward, **timing):
    return {
        "step": step,
        "throughput/tokens_per_s": tokens_per_s,
        "timing/step_s": step_s,
        "reward/mean": reward,
        "timing/train_s": step_s / 2,
        "timing/rollout_s": step_s / 4,
        **timing,
    }


def _ahead(step, tokens_per_s, step_s, reward, k, overlap, train_idle):
    return _row(
        step,
        tokens_per_s,
        step_s,
        reward,
        **{
            "timing/generation_s": 0.5,
            "timing/overlap_fraction": overlap,
            "timing/train_idle_s": train_idle,
            "timing/rollout_idle_s": 0.25,
            "rollout/staleness_mean": float(k and step > 1),
            "rollout/staleness_max": int(k and step > 1),
        },
    )


ROWS = {
    "colocated": [_row(1, 100.0, 10.0, 0.1), _row(2, 200.0, 1.0, 0.2), _row(3, 100.0, 3.0, 0.3)],
    "disaggregated_k0": [
        _ahead(1, 50.0, 8.0, 0.1, 0, 0.0, 4.0),
        _ahead(2, 100.0, 2.0, 0.2, 0, 0.0, 0.5),
        _ahead(3, 100.0, 2.0, 0.3, 0, 0.0, 0.75),
    ],
    "disaggregated_k1": [
        _ahead(1, 50.0, 8.0, 0.1, 1, 0.0, 4.0),
        _ahead(2, 250.0, 1.0, 0.25, 1, 0.25, 0.0),
        _ahead(3, 150.0, 1.0, 0.5, 1, 0.5, 0.0),
    ],
}


def test_summary_of_metrics_rows():
    out = bench.summarize(ROWS)
    colocated, k0, k1 = (out["modes"][m] for m in ("colocated", "disaggregated_k0", "disaggregated_k1"))
    # Steps 2..3 only: colocated 200 x 1 + 100 x 3 = 500 tokens in 4 s (the mean of the rates would say 150).
    assert (colocated["tokens"], colocated["seconds"], colocated["tokens_per_s"]) == (500.0, 4.0, 125.0)
    assert (colocated["step_s"], colocated["train_s"], colocated["rollout_s"]) == (2.0, 1.0, 0.5)
    for key in (
        "generation_s",
        "overlap_fraction",
        "train_idle_s",
        "rollout_idle_s",
        "rollout_busy_fraction",
        "staleness_mean",
        "staleness_max",
    ):
        assert colocated[key] is None, key  # colocated runs log none of them
    assert colocated["reward_curve"] == [0.1, 0.2, 0.3] and colocated["timed_steps"] == 2
    assert (k0["tokens_per_s"], k0["step_s"], k0["train_idle_s"], k0["overlap_fraction"]) == (100.0, 2.0, 0.625, 0.0)
    assert (k0["staleness_mean"], k0["staleness_max"], k0["generation_s"], k0["rollout_idle_s"]) == (0.0, 0, 0.5, 0.25)
    assert (k1["tokens_per_s"], k1["step_s"], k1["train_idle_s"], k1["overlap_fraction"]) == (200.0, 1.0, 0.0, 0.375)
    assert (k1["staleness_mean"], k1["staleness_max"], k1["reward_curve"]) == (1.0, 1, [0.1, 0.25, 0.5])
    # 0.5 s of generation in each timed step: 1.0 s of 4 s (k0) and of 2 s (k1).
    assert (k0["rollout_busy_fraction"], k1["rollout_busy_fraction"]) == (0.25, 0.5)
    assert (out["speedup_k1_vs_k0"], out["speedup_k0_vs_colocated"], out["speedup_k1_vs_colocated"]) == (2.0, 0.8, 1.6)
    assert "speedup_k1_partial_vs_k0" not in out  # not run
    partial = [{**r, "rollout/partial_samples": 2 * r["step"]} for r in ROWS["disaggregated_k1"]]
    partial[2]["timing/step_s"] = 2.0  # 150 tokens/s x 2 s: 550 tokens in 3 s
    out = bench.summarize({"disaggregated_k0": ROWS["disaggregated_k0"], "disaggregated_k1_partial": partial})
    assert out["modes"]["disaggregated_k1_partial"]["partial_samples"] == 5.0  # steps 2, 3: 4 and 6
    assert out["speedup_k1_partial_vs_k0"] == pytest.approx(550 / 3 / 100)
    assert set(k for k in out if k.startswith("speedup")) == {"speedup_k1_partial_vs_k0"}


def test_trained_samples_per_second_ignore_answer_length():
    """k1's answers are twice as long here: twice the tokens/s in the same step time, but the
    same trained samples per second (kept groups x n_samples over the step times)."""
    k0 = [{**r, "rollout/kept_groups": 4} for r in ROWS["disaggregated_k0"]]
    k1 = [
        {**r, "rollout/kept_groups": 4, "timing/step_s": 2.0, "throughput/tokens_per_s": 200.0}
        for r in ROWS["disaggregated_k0"]
    ]
    out = bench.summarize({"disaggregated_k0": k0, "disaggregated_k1": k1}, n_samples=8)
    assert out["modes"]["disaggregated_k0"]["samples_per_s"] == 32 * 2 / 4.0  # steps 2, 3: 2 s each
    assert (out["speedup_k1_vs_k0"], out["speedup_samples_k1_vs_k0"]) == (2.0, 1.0)
    assert (
        bench.summarize({"disaggregated_k0": k0})["modes"]["disaggregated_k0"]["samples_per_s"] is None
    )  # no n_samples
    assert bench.summarize({"colocated": ROWS["colocated"]})["modes"]["colocated"]["samples_per_s"] is None


def test_summary_needs_rows_past_the_first_step():
    with pytest.raises(ValueError, match=r"no metrics rows from step 2 on \(steps logged: \[1\]\)"):
        bench.summarize_mode(ROWS["colocated"][:1])


@pytest.mark.parametrize("outcome", ["exit", "timeout"])
def test_a_failed_launch_is_one_line_and_exit_1(tmp_path, monkeypatch, capsys, outcome):
    """The launcher is replaced: nothing is launched, the first run 'fails' and none follows."""
    import subprocess

    from megatron_rl_lab.testing import torchrun

    calls = []

    def fake(cmd, env, timeout_s):
        calls.append(cmd)
        if outcome == "timeout":
            raise subprocess.TimeoutExpired(cmd, timeout_s, output="partial\n", stderr="")
        return subprocess.CompletedProcess(cmd, 3, "step 1/8\n", "RuntimeError: boom\n")

    monkeypatch.setattr(torchrun, "run_process_group", fake)
    assert main(["async", "--dir", str(tmp_path / "runs"), "--timeout", "7"]) == 1
    err = capsys.readouterr().err.splitlines()
    log = tmp_path / "runs" / "colocated.log"
    want = "colocated did not finish in --timeout 7 s" if outcome == "timeout" else "colocated exited 3 after 0 s"
    assert err[-1].startswith(f"megatron-rl bench async: {want}") and str(log) in err[-1], err
    assert len(calls) == 1 and log.read_text().startswith(("partial", "step 1/8"))
