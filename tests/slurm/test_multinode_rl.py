"""The RL trainer across the namespace nodes of the test cluster (partition `nodes`): what only
happens when ranks are on different hosts.

DAPO with vLLM rollouts on a tiny MoE actor, fp32, launched by scripts/slurm/train_torchrun.sbatch
(one torchrun per node). Six launches, side by side:

1. ``dp2_nodes``: 2 nodes x 1 rank (DP2), 3 steps, a checkpoint every 2; ``dp2_host``: the same
   config on the host node, 1 x 2 ranks; ``ep2_nodes``: the experts split across the 2 nodes (EP2);
   ``pp2_nodes``: the two layers split across 2 nodes (PP2, activations sent between nodes).
2. Once ``dp2_nodes`` is done, its step-2 checkpoint resumed on one node (1 x 2 ranks: the saving
   world size, so RNG states come back too) and on three (3 x 1 ranks: DP3, the model and the
   distributed optimizer resharded, RNG states not restored: they belong to the saving layout).

EP2 and PP2 are not run again on the host node: gloo carries their collectives over TCP on
one host as across nodes, and the weight sync, the one path that differs (a broadcast, not
the shared arena), is checked against vLLM's own logprobs every step (the parity keys) and
on DP2 against the host run number for number.

Across nodes the weight sync cannot share memory, so it gathers by gloo broadcasts
(``rollout/weight_sync_broadcast``, bridge/gather_plan.py), and every node's rank writes its own
data file into the shared run directory (the metadata names each writer's host). Prompts are
seeded one by one, so which engine draws a prompt does not change its samples.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rl.checkpoint import format as fmt
from tests.distributed.trainer_runs import small_base

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
STEPS, SAVE_INTERVAL, RESUMED_STEPS = 3, 2, 4
PROMPTS_PER_STEP = 4
MINI_BATCHES_PER_STEP = 2  # examples/dapo.yaml: optimizer steps per trained step
JOB_TIMEOUT_S = 600  # the machine is shared; a quiet one needs about a tenth of it
TWO_NODES = ("-p", "nodes", "-N2", "-w", "mrl-n1,mrl-n2")  # mrl-n3 is the one the drills cut off
OTHER_TWO_NODES = ("-p", "nodes", "-N2", "-w", "mrl-n2,mrl-n3")
HOST = ("-p", "debug", "-N1")
NOT_COMPARED = (
    "timing/",
    "throughput/",
    "slurm/",
    "rollout/weight_sync_broadcast",
    "rollout/logprob_abs_diff",
    "rollout/mismatch_k3_kl",
    "rollout/parity_",
    "rollout/weight_check_elements",
)
"""What depends on the launch (times, restarts, how the sync gathered) or on the batch an
engine ran a prompt in (vLLM's logprobs, as in tests/distributed/test_trainer.py)."""
ROLLOUT = (
    "reward/mean",
    "response_length/mean",
    "rollout/kept_groups",
    "rollout/generated_groups",
    "rollout/generation_batches",
    "data/prompts_drawn",
)
"""What a step's rollouts are: the same prompts and samples give the same values."""
FP32_PARITY_MAX = 1e-5  # tests/distributed/test_trainer.py: vLLM == Megatron after a sync


class Launch:
    """``sbatch --wait`` of train_torchrun.sbatch, watched from the test."""

    def __init__(
        self, env: dict, base: Path, run_dir: Path, sbatch_args, ranks_per_node: int, *overrides, steps: int = STEPS
    ):
        self.run_dir, self.log = run_dir, run_dir.parent / f"{run_dir.name}.log"
        cmd = [
            "sbatch",
            "--wait",
            f"--output={self.log}",
            *sbatch_args,
            str(REPO / "scripts" / "slurm" / "train_torchrun.sbatch"),
            str(run_dir),
            str(REPO / "examples" / "dapo.yaml"),
            f"model.hf_path={base}",
            f"data.source={base}/train.jsonl",
            "data.reward=digits",
            f"trainer.max_steps={steps}",
            f"checkpoint.save_interval={SAVE_INTERVAL}",
            f"rollout.prompts_per_step={PROMPTS_PER_STEP}",
            "rollout.n_samples=4",
            "trainer.micro_batch_size=2",
            "rollout.seed_per_prompt=true",
            "rollout.parity_every=1",
            "eval.sets={}",  # the recipe's held-out split is a task's; this run reads a prompt file
            *overrides,
        ]
        # sbatch exports this environment to the job (PYTHONPATH included: the code under test).
        # No requeue: a failure here is the test's finding, not a fault to ride out.
        env = dict(
            env,
            MRL_PYTHON=sys.executable,
            MRL_NPROC_PER_NODE=str(ranks_per_node),
            MRL_MAX_RESTARTS="0",
            OMP_NUM_THREADS="1",
            HF_HUB_OFFLINE="1",
        )
        self.started = time.time()
        self.proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def finish(self) -> "Launch":
        try:
            _, err = self.proc.communicate(timeout=JOB_TIMEOUT_S - (time.time() - self.started))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"{self.run_dir.name}: still running after {JOB_TIMEOUT_S} s:\n{self.text()[-5000:]}")
        self.seconds = time.time() - self.started
        print(f"{self.run_dir.name}: {self.seconds:.1f} s")
        assert self.proc.returncode == 0, (
            f"{self.run_dir.name}: sbatch exit {self.proc.returncode} {err}\n{self.text()[-5000:]}"
        )
        assert "trainer status 0" in self.text(), self.text()[-5000:]
        self.rows = [json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()]
        return self

    def text(self) -> str:
        return self.log.read_text() if self.log.exists() else "(no log)"

    def metadata(self, step: int) -> fmt.Metadata:
        return fmt.read_metadata(self.run_dir / "checkpoints", step)


def _trained(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(NOT_COMPARED)}


def _resumable_copy(source: Path, step: int, run_dir: Path) -> Path:
    """A run dir holding only ``source``'s checkpoint of ``step`` and its metrics up to it."""
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(fmt.step_dir(source / "checkpoints", step), fmt.step_dir(run_dir / "checkpoints", step))
    rows = (source / "metrics.jsonl").read_text().splitlines()[:step]
    (run_dir / "metrics.jsonl").write_text("".join(line + "\n" for line in rows))
    return run_dir


def _files_of(meta: fmt.Metadata, pattern: str) -> set[str]:
    """The data files holding the chunks of the tensors whose name matches ``pattern``."""
    return {c.file for name, e in meta.tensors.items() if re.search(pattern, name) for c in e.chunks}


def _check_written_only_to(meta: fmt.Metadata, tensors: str, file: str) -> None:
    """The weights matching ``tensors`` (a name prefix pattern) and their Adam state are all in ``file``."""
    assert _files_of(meta, rf"^{tensors}") == {file}, tensors
    assert _files_of(meta, rf"^optimizer\.\w+\.{tensors}") == {file}, tensors


def _adam_steps(meta: fmt.Metadata) -> set[float]:
    return {dict(fmt.decode(group))["step"] for group in meta.optimizer["param_groups"]}


@pytest.fixture(scope="module")
def runs(slurm_env, tmp_path_factory) -> dict[str, Launch]:
    root = tmp_path_factory.mktemp("multinode")
    base = Path(small_base("qwen3_moe"))  # the trainer modules' MoE base, one build per session
    first = {
        "dp2_nodes": Launch(slurm_env, base, root / "dp2_nodes", TWO_NODES, 1),
        "dp2_host": Launch(slurm_env, base, root / "dp2_host", HOST, 2),
        "ep2_nodes": Launch(
            slurm_env,
            base,
            root / "ep2_nodes",
            TWO_NODES,
            1,
            "parallel.expert_model_parallel_size=2",
            steps=SAVE_INTERVAL,
        ),
        "pp2_nodes": Launch(
            slurm_env,
            base,
            root / "pp2_nodes",
            OTHER_TWO_NODES,
            1,
            "parallel.pipeline_model_parallel_size=2",
            steps=SAVE_INTERVAL,
        ),
    }
    done = {"dp2_nodes": first.pop("dp2_nodes").finish()}
    source = done["dp2_nodes"].run_dir
    second = {  # started while the other first launches still run
        "resumed_1x2": Launch(
            slurm_env,
            base,
            _resumable_copy(source, SAVE_INTERVAL, root / "resumed_1x2"),
            ("-p", "debug", "-N1"),
            2,
            steps=RESUMED_STEPS,
        ),
        "resumed_3x1": Launch(
            slurm_env,
            base,
            _resumable_copy(source, SAVE_INTERVAL, root / "resumed_3x1"),
            ("-p", "nodes", "-N3"),
            1,
            steps=RESUMED_STEPS,
        ),
    }
    done.update({name: launch.finish() for name, launch in {**first, **second}.items()})
    return done


def _check_same_layout_on_one_host(nodes: Launch, host: Launch) -> None:
    """The layout across 2 nodes trains what it trains on one host: every trained-on number
    of every step equal in fp32; only the sync's transport differs."""
    assert [r["step"] for r in nodes.rows] == [r["step"] for r in host.rows]
    for got, want in zip(nodes.rows, host.rows):
        assert _trained(got) == _trained(want), (got["step"], got, want)
    assert all(r["rollout/weight_sync_broadcast"] == 0.0 for r in host.rows)


def test_dp2_across_two_nodes_trains_what_one_node_does(runs):
    nodes, host = runs["dp2_nodes"], runs["dp2_host"]
    assert "on mrl-n[1-2] (2 x 1 ranks)" in nodes.text() and "(1 x 2 ranks)" in host.text()
    assert [r["step"] for r in nodes.rows] == [r["step"] for r in host.rows] == list(range(1, STEPS + 1))
    assert all(r["actor/updated"] for r in nodes.rows), nodes.rows  # every step trained and synced
    _check_same_layout_on_one_host(nodes, host)
    for got in nodes.rows:
        assert got["rollout/parity_max_abs_diff"] < FP32_PARITY_MAX and got["rollout/weight_check_elements"] > 0
    # Across namespaces no memory is shared: the sync broadcast (on one host it used the arena,
    # which _check_same_layout_on_one_host checks).
    assert [r["rollout/weight_sync_broadcast"] for r in nodes.rows] == [1.0] * STEPS


def test_each_node_writes_its_share_of_the_checkpoint(runs):
    nodes, host = runs["dp2_nodes"], runs["dp2_host"]
    meta = nodes.metadata(STEPS)
    assert meta.hosts == {"0": "mrl-n1", "1": "mrl-n2"} and meta.layout["world_size"] == 2
    assert host.metadata(STEPS).hosts == {"0": socket.gethostname(), "1": socket.gethostname()}
    # Replicated weights go to a balanced choice of writer, the distributed optimizer's
    # shards to their owners: both nodes wrote model tensors and optimizer state.
    assert _files_of(meta, r"^(?!optimizer\.)") == _files_of(meta, r"^optimizer\.") == {"data_0.bin", "data_1.bin"}
    sizes = [(nodes.run_dir / "checkpoints" / f"step_{STEPS}" / f"data_{r}.bin").stat().st_size for r in (0, 1)]
    assert min(sizes) > 0.4 * sum(sizes), sizes  # about half each
    # The same step saved on one host holds the same tensors, whoever wrote them.
    assert {n: (e.dtype, e.shape) for n, e in host.metadata(STEPS).tensors.items()} == {
        n: (e.dtype, e.shape) for n, e in meta.tensors.items()
    }


def _check_first_step_as_dp2(run: Launch, dp2: Launch) -> None:
    """Every step trained and synced by broadcast with parity; the first samples the base model:
    the same rollouts as DP2, and the same update up to the order of fp32 sums."""
    assert [r["step"] for r in run.rows] == list(range(1, SAVE_INTERVAL + 1))
    for r in run.rows:
        assert r["actor/updated"] and r["rollout/weight_sync_broadcast"] == 1.0, r
        assert r["rollout/parity_max_abs_diff"] < FP32_PARITY_MAX and r["rollout/weight_check_elements"] > 0, r
    first, reference = run.rows[0], dp2.rows[0]
    assert {k: first[k] for k in ROLLOUT} == {k: reference[k] for k in ROLLOUT}
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/clipfrac"):
        assert first[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-7), key


def test_ep2_splits_the_experts_across_the_nodes(runs):
    ep2 = runs["ep2_nodes"]
    assert "on mrl-n[1-2] (2 x 1 ranks)" in ep2.text()
    # The experts' gradients are no longer averaged over two ranks: equal up to fp32 sums.
    _check_first_step_as_dp2(ep2, runs["dp2_nodes"])
    # Each node's rank owns four of the eight experts and writes them, weights and Adam state.
    meta = ep2.metadata(SAVE_INTERVAL)
    assert meta.layout["expert_model_parallel_size"] == 2 and meta.hosts == {"0": "mrl-n1", "1": "mrl-n2"}
    for experts, file in (("[0-3]", "data_0.bin"), ("[4-7]", "data_1.bin")):
        _check_written_only_to(meta, rf"decoder\.layers\.\d+\.mlp\.experts\.{experts}\.", file)


def test_pp2_sends_activations_between_the_nodes(runs):
    pp2 = runs["pp2_nodes"]
    assert "on mrl-n[2-3] (2 x 1 ranks)" in pp2.text()
    _check_first_step_as_dp2(pp2, runs["dp2_nodes"])
    # Each node's stage holds one of the two layers and writes it, weights and Adam state.
    meta = pp2.metadata(SAVE_INTERVAL)
    assert meta.layout["pipeline_model_parallel_size"] == 2 and meta.hosts == {"0": "mrl-n2", "1": "mrl-n3"}
    for layer, file in (("0", "data_0.bin"), ("1", "data_1.bin")):
        _check_written_only_to(meta, rf"decoder\.layers\.{layer}\.", file)


def _check_continued(resumed: Launch, source: Launch) -> None:
    """Steps 1..SAVE_INTERVAL kept as the 2-node run logged them, then the resumed steps, and the
    data position going on: every prompt drawn once (dynamic sampling draws whole batches)."""
    assert f"resumed from {resumed.run_dir / 'checkpoints'} step {SAVE_INTERVAL}" in resumed.text()
    rows = resumed.rows
    assert [r["step"] for r in rows] == list(range(1, RESUMED_STEPS + 1))
    assert rows[:SAVE_INTERVAL] == source.rows[:SAVE_INTERVAL]
    drawn = 0
    for r in rows:
        drawn += r["rollout/generation_batches"] * PROMPTS_PER_STEP
        assert r["data/prompts_drawn"] == drawn, (r["step"], r["data/prompts_drawn"], drawn)
    assert all(r["actor/updated"] for r in rows[SAVE_INTERVAL:]), rows
    saved = resumed.metadata(RESUMED_STEPS)
    assert saved.extra["step"] == RESUMED_STEPS and saved.extra["data"]["index"] == drawn  # epoch 0 of 300
    # Adam's step count went on from the checkpoint's: the optimizer state was loaded, not reset.
    loaded = _adam_steps(source.metadata(SAVE_INTERVAL))
    assert loaded == {SAVE_INTERVAL * MINI_BATCHES_PER_STEP}
    assert _adam_steps(saved) == {s + (RESUMED_STEPS - SAVE_INTERVAL) * MINI_BATCHES_PER_STEP for s in loaded}


def test_two_node_checkpoint_resumes_on_one_node_exactly(runs):
    """The saving world size (2) on one host: RNG states restored too, so the step after the
    checkpoint is the one the 2-node run computed, every trained-on number equal."""
    resumed, source = runs["resumed_1x2"], runs["dp2_nodes"]
    _check_continued(resumed, source)
    assert "RNG states not restored" not in resumed.text()
    assert _trained(resumed.rows[SAVE_INTERVAL]) == _trained(source.rows[SAVE_INTERVAL])
    assert resumed.rows[-1]["rollout/weight_sync_broadcast"] == 0.0
    assert resumed.metadata(RESUMED_STEPS).hosts == {"0": socket.gethostname(), "1": socket.gethostname()}


def test_two_node_checkpoint_resumes_on_three_nodes_in_dp3(runs):
    """World 3: the model and the distributed optimizer are resharded from DP2 to DP3. The step
    after the checkpoint samples the loaded weights, so its rollouts are the 2-node run's; its
    update differs (DP3 keeps the groups whose rows divide by 3 x 2 mini-batches)."""
    resumed, source = runs["resumed_3x1"], runs["dp2_nodes"]
    _check_continued(resumed, source)
    assert "on mrl-n[1-3] (3 x 1 ranks)" in resumed.text() and "RNG states not restored" in resumed.text()
    step = resumed.rows[SAVE_INTERVAL]
    assert {k: step[k] for k in ROLLOUT if k != "rollout/kept_groups"} == {
        k: source.rows[SAVE_INTERVAL][k] for k in ROLLOUT if k != "rollout/kept_groups"
    }
    assert all(r["rollout/weight_sync_broadcast"] == 1.0 for r in resumed.rows[SAVE_INTERVAL:])
    assert all(r["rollout/parity_max_abs_diff"] < FP32_PARITY_MAX for r in resumed.rows[SAVE_INTERVAL:])
    meta = resumed.metadata(RESUMED_STEPS)
    assert meta.layout["world_size"] == 3 and meta.hosts == {"0": "mrl-n1", "1": "mrl-n2", "2": "mrl-n3"}
    assert _files_of(meta, r"^optimizer\.") == {"data_0.bin", "data_1.bin", "data_2.bin"}
