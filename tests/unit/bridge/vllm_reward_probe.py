"""Subprocess body of test_reward_model_export.py (vLLM keeps process-wide state).

Arguments: HF_DIR TOKEN_ID_LISTS_JSON. Prints one JSON line: VllmRewardModel's score of
each token-id list.
"""

import json
import sys

from megatron_rl.rewards.vllm_reward_model import VllmRewardModel

model = VllmRewardModel(sys.argv[1], max_model_len=64, log_level="error")
scores = model.score(json.loads(sys.argv[2]))
model.close()
print(json.dumps(scores))
