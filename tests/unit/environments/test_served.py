"""Episodes on rollout ranks of their own, without a bridge or an engine: their commands
travel through the bridge's pickle, and a rollout server given the episode service serves
them in command order (each batch stamped with the version served, after the wait before
it), refuses a batch before the drivers are built, and closes them at Stop."""

import collections
import pickle
import queue

import pytest

from megatron_rl.environments.driver import DriverConfig, DriverTimes
from megatron_rl.environments.interface import EpisodeRecord
from megatron_rl.environments.sandbox import SandboxConfig
from megatron_rl.environments.served import (
    EPISODE_COMMANDS,
    EpisodeGeneration,
    EpisodeService,
    GenerateEpisodes,
    StartEpisodes,
)
from megatron_rl.environments.spec import EpisodeSpec
from megatron_rl.rollout import commands
from megatron_rl.rollout.channel import _to_bytes
from megatron_rl.rollout.server import RolloutServer, command_handlers

SPEC = EpisodeSpec(
    environment="tools",
    reward="digits",
    tools=("python",),
    sandbox=SandboxConfig(),
    parser="hermes",
    driver=DriverConfig(),
)
RECORDS = [EpisodeRecord.from_messages([{"role": "user", "content": "2+2?"}], "4")]


@pytest.mark.parametrize("message", [StartEpisodes(SPEC, "/models/tiny"), GenerateEpisodes(RECORDS, [12])])
def test_the_episode_commands_travel_through_the_bridges_pickle(message):
    travelled = pickle.loads(_to_bytes(message).numpy().tobytes())
    assert type(travelled) is type(message) and travelled == message


class ScriptedEpisodes:
    """Stands in for a rank's EpisodeReplicas: one result per record, records its calls."""

    def __init__(self):
        self.runs, self.closed = [], 0

    def run(self, records, seeds, version):
        self.runs.append((len(records), seeds, version))
        return [f"episode {i}" for i in range(len(records))], DriverTimes(engine_calls=1)

    def close(self):
        self.closed += 1


class _Answers:
    def __init__(self):
        self.sent = []

    def send_object(self, obj, dst):
        self.sent.append(obj)


def _server(service, messages) -> RolloutServer:
    """A rollout server with no bridge and no engine: ``messages`` queued, answers kept."""
    server = object.__new__(RolloutServer)
    server.extension, server.handlers, server.leader = service, command_handlers(service), True
    server.replicas, server.version, server.rank = None, 0, 0
    server.pending, server.taken, server.idle_s, server.up = collections.deque(), 0, 0.0, _Answers()
    server.inbox = queue.Queue()
    for message in [*messages, commands.Stop()]:
        server.inbox.put((message, None))
    return server


class _Updates:
    """The engines' side of a weight update's finish."""

    def finish_weight_update(self):
        pass


def test_the_service_serves_episode_batches_in_order_stamped_and_closes_at_stop():
    service = EpisodeService()
    assert tuple(service.handlers()) == EPISODE_COMMANDS
    service.episodes = episodes = ScriptedEpisodes()  # as StartEpisodes builds them
    batch = GenerateEpisodes(RECORDS * 2, [0, 3])
    server = _server(service, [batch, commands.FinishUpdate(), batch])
    server.replicas, server.idle_s = _Updates(), 1.5
    assert server.serve() == 3
    assert episodes.runs == [(2, [0, 3], 0), (2, [0, 3], 1)]  # the second after the update
    first, second = server.up.sent[0][2], server.up.sent[2][2]
    assert isinstance(first, EpisodeGeneration) and first.results == ["episode 0", "episode 1"]
    assert first.idle_s >= 1.5 and second.idle_s < 1.5 and first.times.engine_calls == 1  # the wait taken once
    assert episodes.closed == 1 and server.up.sent[-1] == (3, "stopped", None)


def test_episodes_need_their_drivers_and_the_drivers_the_engines():
    with pytest.raises(RuntimeError, match="GenerateEpisodes: the rollout ranks were not sent StartEpisodes"):
        _server(EpisodeService(), [])._run(GenerateEpisodes(RECORDS), None)
    with pytest.raises(RuntimeError, match="StartEpisodes: the engines are not started"):
        _server(EpisodeService(), [])._run(StartEpisodes(SPEC, "/models/tiny"), None)


def test_a_server_without_the_service_refuses_the_episode_commands():
    with pytest.raises(commands.UnknownCommandError, match="GenerateEpisodes is not a rollout command"):
        _server(None, [])._run(GenerateEpisodes(RECORDS), None)
