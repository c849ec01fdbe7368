"""The colocated engines' replicas and the rollout ranks' client are one typed backend, and the
commands between the training and rollout ranks are typed messages.

The engines themselves run in tests/distributed (colocated: test_weight_sync.py's engine tests; the
client and server over a real bridge: test_trainer.py's disaggregated runs); here, without
an engine or a bridge: the methods the protocol names, the messages' trip through pickle
(what the bridge carries), and the refusal of anything else.
"""

import collections
import dataclasses
import inspect
import pickle
import queue

import pytest
import torch

from megatron_rl.data import PromptBatch
from megatron_rl.rollout import commands
from megatron_rl.rollout.backend import RolloutBackend
from megatron_rl.rollout.channel import _to_bytes
from megatron_rl.rollout.client import RolloutClient
from megatron_rl.rollout.replicas import Replicas
from megatron_rl.rollout.server import HANDLERS, RolloutServer, command_handlers
from megatron_rl.rollout.types import EngineConfig, Sample, Sampling

IMPLEMENTATIONS = [Replicas, RolloutClient]
PROTOCOL_METHODS = [
    name for name, value in vars(RolloutBackend).items() if inspect.isfunction(value) and not name.startswith("_")
]


def test_the_protocol_names_what_the_trainer_uses():
    assert sorted(PROTOCOL_METHODS) == sorted(
        [
            "generate_groups",
            "generate_eval",
            "continue_samples",
            "prompt_logprobs",
            "load_weights",
            "load_adapter",
            "check_weights",
            "finish_weight_update",
            "close",
        ]
    )
    assert "config" in RolloutBackend.__annotations__


@pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_each_implementation_has_the_protocols_methods_with_its_parameters(cls):
    for name in PROTOCOL_METHODS:
        expected = list(inspect.signature(getattr(RolloutBackend, name)).parameters)
        assert list(inspect.signature(getattr(cls, name)).parameters) == expected, f"{cls.__name__}.{name}"
    assert "config" in cls.__annotations__


@pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_each_implementation_is_a_rollout_backend_at_runtime(cls):
    backend = object.__new__(cls)  # no engine and no bridge: only the interface is checked
    assert not isinstance(backend, RolloutBackend), "config is an instance attribute"
    backend.config = EngineConfig()
    assert isinstance(backend, RolloutBackend)


def _sample() -> Sample:
    return Sample(prompt_ids=[1, 2], token_ids=[3], logprobs=[-0.5], finish_reason="window")


MESSAGES = [
    commands.Start("/models/tiny", EngineConfig(tensor_parallel_size=2)),
    commands.Generate(PromptBatch([[1, 2]], ["4"], [0], [0], [0]), Sampling(n=2), chunk_tokens=3),
    commands.GenerateEval([[1, 2], [3]], Sampling(n=2, logprobs=False), [4096, 8192]),
    commands.Continue([_sample()], Sampling(window=4)),
    commands.PromptLogprobs([[1, 2, 3]]),
    commands.LoadBucket((commands.TensorSpec("w", (2, 3), torch.bfloat16),)),
    commands.CheckBucket((commands.TensorSpec("w", (2, 3), torch.float32),)),
    commands.LoadAdapter({"r": 8, "lora_alpha": 16.0}, (commands.TensorSpec("a", (8, 4), torch.float32),)),
    commands.FinishUpdate(),
    commands.Stop(),
]


def test_every_command_is_a_message_with_a_handler_or_ends_serving():
    assert {type(m) for m in MESSAGES} == set(commands.COMMANDS)
    assert set(HANDLERS) == set(commands.COMMANDS) - {commands.Stop}
    for message in MESSAGES:
        assert dataclasses.is_dataclass(message) and type(message).__dataclass_params__.frozen


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_messages_travel_through_the_bridges_pickle(message):
    travelled = pickle.loads(_to_bytes(message).numpy().tobytes())
    assert type(travelled) is type(message) and travelled == message


def bare_server(extension=None) -> RolloutServer:
    """A server with no bridge and no engine: what its dispatch needs, and nothing else."""
    server = object.__new__(RolloutServer)
    server.extension, server.handlers, server.leader = extension, command_handlers(extension), True
    return server


@dataclasses.dataclass(frozen=True)
class Reboot:
    """Not a rollout command."""


def test_an_unknown_message_is_refused_by_name_on_both_sides():
    with pytest.raises(commands.UnknownCommandError, match="Reboot is not a rollout command; the commands are Start,"):
        commands.check_command(Reboot())
    client = object.__new__(RolloutClient)  # refused before anything is counted or sent
    with pytest.raises(commands.UnknownCommandError, match="Reboot"):
        client.submit(Reboot())
    with pytest.raises(commands.UnknownCommandError, match="Reboot"):
        bare_server()._run(Reboot(), None)


def test_a_bucket_goes_only_with_a_bucket_command():
    client = object.__new__(RolloutClient)
    with pytest.raises(ValueError, match="FinishUpdate: a bucket goes with LoadBucket, CheckBucket, LoadAdapter only"):
        client.submit(commands.FinishUpdate(), [("w", torch.zeros(2))])
    with pytest.raises(ValueError, match="LoadBucket"):
        client.submit(commands.LoadBucket())


class _EvalReplicas:
    """Answers an eval generation with one empty group per prompt; counts weight updates."""

    def __init__(self):
        self.updates = 0

    def finish_weight_update(self):
        self.updates += 1

    def generate_eval(self, prompt_ids, sampling, seeds):
        from megatron_rl.rollout.types import EvalSamples

        return EvalSamples([[] for _ in prompt_ids])


class _Answers:
    def __init__(self):
        self.sent = []

    def send_object(self, obj, dst):
        self.sent.append(obj)


def queued_server(messages, extension=None) -> RolloutServer:
    """A bare server whose inbox holds ``messages`` (no bridge), keeping its answers in ``up.sent``."""
    server = bare_server(extension)
    server.replicas, server.version, server.rank = _EvalReplicas(), 0, 0
    server.pending, server.taken, server.idle_s, server.up = collections.deque(), 0, 0.0, _Answers()
    server.inbox = queue.Queue()
    for message in messages:
        server.inbox.put((message, None))
    return server


def test_the_rollout_ranks_evaluate_after_the_updates_sent_before_and_stamp_their_version():
    """An eval command sent after a weight update samples the updated weights: the server runs
    commands in order and answers it with the version it serves then."""
    evaluate = commands.GenerateEval([[1], [2]], Sampling(n=2, logprobs=False), [0, 4096])
    server = queued_server([evaluate, commands.FinishUpdate(), evaluate, commands.FinishUpdate(), evaluate])
    server.inbox.put((commands.Stop(), None))
    assert server.serve() == 5
    evaluated = [(number, value) for number, status, value in server.up.sent if number in (0, 2, 4)]
    assert [(n, v.policy_version, len(v.groups)) for n, v in evaluated] == [(0, 0, 2), (2, 1, 2), (4, 2, 2)]
    assert server.replicas.updates == 2 and server.up.sent[-1] == (5, "stopped", None)


@dataclasses.dataclass(frozen=True)
class Ping:
    """A command of a layer above rollout (as the episodes' are)."""

    value: int


class PingService:
    """A server extension: answers Ping with its value and the policy version served."""

    def __init__(self):
        self.closed = 0

    def handlers(self):
        return {Ping: lambda server, command, bucket: (command.value, server.version)}

    def close(self):
        self.closed += 1


def test_a_layer_above_adds_commands_that_only_the_sides_told_of_them_accept():
    told = object.__new__(RolloutClient)
    told.extra_commands = (Ping,)
    with pytest.raises(commands.UnknownCommandError, match="Reboot is not a rollout command; .*, Stop, Ping$"):
        told.submit(Reboot())  # still refused, by name, with the commands this side knows
    with pytest.raises(commands.UnknownCommandError, match="Ping is not a rollout command"):
        object.__new__(RolloutClient).submit(Ping(1))
    with pytest.raises(commands.UnknownCommandError, match="Ping is not a rollout command"):
        bare_server()._run(Ping(1), None)
    with pytest.raises(commands.UnknownCommandError, match="Reboot"):
        bare_server(PingService())._run(Reboot(), None)
    assert queued_server([], PingService())._run(Ping(3), None) == (3, 0)


def test_an_extension_is_served_in_order_and_closed_at_stop_before_the_answer():
    service = PingService()
    server = queued_server([Ping(1), commands.FinishUpdate(), Ping(2)], service)
    server.inbox.put((commands.Stop(), None))
    assert server.serve() == 3 and service.closed == 1
    assert server.up.sent == [(0, "ok", (1, 0)), (1, "ok", None), (2, "ok", (2, 1)), (3, "stopped", None)]


def test_an_extension_cannot_take_over_a_rollout_command():
    class Hijack(PingService):
        def handlers(self):
            return {Ping: None, commands.Generate: None}

    with pytest.raises(ValueError, match="cannot serve rollout's own commands: Generate"):
        command_handlers(Hijack())


class _AdapterReplicas(_EvalReplicas):
    """Keeps the adapters it is given, with the version they arrived under."""

    def __init__(self):
        super().__init__()
        self.adapters = []

    def load_adapter(self, tensors, peft_config):
        self.adapters.append(({k: v.clone() for k, v in tensors.items()}, peft_config, self.updates))


def test_an_adapter_travels_to_the_rollout_ranks_whole_and_is_served_from_the_update_it_ends():
    """A LoRA sync to rollout ranks of their own: the client packs the PEFT tensors as a bucket
    beside a LoadAdapter command; the server unpacks them for its replicas, which serve them
    from the FinishUpdate that follows (policy version 1)."""
    from megatron_rl.rollout.buckets import pack_bucket, unpack_bucket

    tensors = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(8, 16),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(32, 8, dtype=torch.bfloat16),
    }
    peft_config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16.0}
    specs, flat = pack_bucket(list(tensors.items()))  # what RolloutClient.submit sends
    command = commands.LoadAdapter(peft_config, tuple(specs))
    server = queued_server([])
    server.replicas = _AdapterReplicas()
    server.inbox.put((command, unpack_bucket(command.specs, flat.clone())))
    server.inbox.put((commands.FinishUpdate(), None))
    server.inbox.put((commands.Stop(), None))
    assert server.serve() == 2
    ((got, config, updates_before),) = server.replicas.adapters
    assert config == peft_config and updates_before == 0 and server.version == 1
    assert sorted(got) == sorted(tensors)
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in tensors.items())
