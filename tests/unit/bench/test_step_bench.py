"""`megatron-rl bench step`: the rows from phase times and floors (hand-computed), the phase
clock on a stand-in trainer (what it times and keeps), and bad arguments refused in one line
with exit 2. The measurement itself is a benchmark (docs/benchmarks.md), not a test."""

import argparse

import pytest

from megatron_rl_lab.bench import step
from megatron_rl_lab.bench.args import BenchArgumentError
from megatron_rl_lab.bench.cli import main
from megatron_rl_lab.bench.step_phases import TRAINER_PHASES, PhaseClock, StepRecord


def test_rows_split_the_rollout_price_each_floor_and_leave_the_rest_as_overhead():
    phases = {"rollout": 1.0, "generation": 0.6, "update": 2.0, "weight_sync": 0.5, "critic_values": 0.0001}
    floors = {
        "generation": {"vllm_generate": 0.5},
        "update": {"megatron_forward_backward": 1.0, "transformers_forward_backward": 0.5},
        "weight_sync": {"byte_copy": 0.25},
    }
    rows = step.phase_rows(phases, 4.0, floors)
    got = [(r["phase"], r["floor"], round(r["seconds"], 6), r["ratio"] and round(r["ratio"], 6)) for r in rows]
    assert got == [
        ("generation", "vllm_generate", 0.6, 1.2),
        ("scoring_and_shaping", None, 0.4, None),
        ("update", "megatron_forward_backward", 2.0, 2.0),
        ("update", "transformers_forward_backward", 2.0, 4.0),
        ("weight_sync", "byte_copy", 0.5, 2.0),
        # 4.0 - (0.6 + 0.4 + 2.0 + 0.5 + 0.0001): the idle critic phase is no row but is counted
        ("overhead", "step", 0.4999, 0.124975),
    ]


def test_means_leave_out_the_first_step():
    records = [StepRecord({"update": 9.0}, 20.0), StepRecord({"update": 1.0}, 2.0), StepRecord({"update": 3.0}, 4.0)]
    assert step.mean_phases(records) == ({"update": 2.0}, 3.0)


class Params(str):
    """vLLM's SamplingParams as far as the clock uses them: clone() gives a copy."""

    def clone(self):
        return Params(self + "'")


class StandInEngine:
    def __init__(self):
        self.seen = []

    def generate(self, prompts):
        return self._generate(prompts, [Params("p")])

    def _generate(self, requests, params, on_output=None):
        self.seen.append(requests)
        return []


class StandInTrainer:
    """The methods of RLTrainer the clock wraps, called as RLTrainer.step calls them."""

    def __init__(self):
        self.engine = StandInEngine()
        self.source = self

    def collect(self):
        return self.engine.generate(["a", "b"])

    def step(self, number):
        self.source.collect()
        self.old_logprobs("batch", {})
        self.update(number, "batch", {})
        self.sync_weights(number, [], {})
        self.evaluate(number, {})

    def evaluate(self, number, metrics):
        self.engine.generate(["held-out"])  # the eval's requests: not the step's generation

    def old_logprobs(self, batch, metrics):
        pass

    def update(self, number, batch, metrics):
        return 7

    def sync_weights(self, number, rows, metrics):
        pass


for _method in TRAINER_PHASES:  # the phases this step does not call: present, as on RLTrainer
    if not hasattr(StandInTrainer, _method):
        setattr(StandInTrainer, _method, lambda self, *args: None)


def test_the_clock_times_each_phase_per_step_and_keeps_what_the_floors_replay():
    trainer = StandInTrainer()
    clock = PhaseClock()
    clock.install(trainer)
    trainer.step(1)
    trainer.step(2)
    assert len(clock.steps) == 2
    record = clock.current
    assert set(record.phases) == {"rollout", "generation", "old_logprobs", "update", "weight_sync", "eval"}
    assert record.step_s >= sum(v for k, v in record.phases.items() if k != "generation") >= 0
    assert record.update_batch == "batch"
    assert record.generate_calls == [(["a", "b"], ["p'"])]  # params cloned before the engine ran
    assert trainer.engine.seen == [["a", "b"], ["held-out"]] * 2  # the engine itself still ran


def _args(*argv: str) -> argparse.Namespace:
    sub = argparse.ArgumentParser().add_subparsers()
    return step.add_parser(sub).parse_args(list(argv))


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(BenchArgumentError, match="runs one process .world 1, colocated.; WORLD_SIZE=2"):
        step.make_plan(_args("--config", "examples/grpo.yaml"), world=2)
    with pytest.raises(BenchArgumentError, match="--steps 1: at least 2"):
        step.make_plan(_args("--config", "examples/grpo.yaml", "--steps", "1"), world=1)
    with pytest.raises(BenchArgumentError, match="config file .*nothing.yaml does not exist"):
        step.make_plan(_args("--config", str(tmp_path / "nothing.yaml")), world=1)
    with pytest.raises(BenchArgumentError, match="model.preset='huge' is not allowed"):
        step.make_plan(_args("--config", "examples/grpo.yaml", "--model", "huge"), world=1)
    with pytest.raises(BenchArgumentError, match="placement='disaggregated': bench step runs colocated only"):
        step.make_plan(
            _args(
                "--config",
                "examples/grpo.yaml",
                "--set",
                "rollout.placement=disaggregated",
                "--set",
                "rollout.num_ranks=1",
            ),
            world=1,
        )
    plan = step.make_plan(
        _args("--config", "examples/grpo.yaml", "--model", "tiny-dense", "--set", "trainer.seed=5"), world=1
    )
    assert plan.overrides == ("trainer.seed=5", "model.preset=tiny-dense") and plan.steps == 3


def test_bad_arguments_exit_2(capsys):
    assert main(["step", "--config", "no/such.yaml"]) == 2
    err = capsys.readouterr().err
    assert "megatron-rl bench step: error:" in err and "does not exist" in err
