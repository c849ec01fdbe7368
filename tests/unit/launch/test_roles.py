"""How a disaggregated launch is split (launch/roles.py): which rank trains, which runs vLLM,
each one's rank in its role's world and on the bridge."""

import pytest

from megatron_rl.launch.roles import ROLLOUT, TRAIN, Roles


def test_the_last_ranks_generate_and_training_rank_0_leads_the_bridge():
    roles = Roles(world=5, rollout_ranks=2)
    assert roles.training_ranks == 3
    assert [roles.role(r) for r in range(5)] == [TRAIN, TRAIN, TRAIN, ROLLOUT, ROLLOUT]
    assert [roles.role_rank(r) for r in range(5)] == [0, 1, 2, 0, 1]
    assert [roles.role_size(r) for r in range(5)] == [3, 3, 3, 2, 2]
    assert [roles.bridge_rank(r) for r in range(5)] == [0, None, None, 1, 2]


@pytest.mark.parametrize("rollout_ranks", [0, 4, 5])
def test_both_roles_need_a_rank(rollout_ranks):
    with pytest.raises(ValueError, match=f"{rollout_ranks} rollout ranks in a launch of 4"):
        Roles(world=4, rollout_ranks=rollout_ranks)
