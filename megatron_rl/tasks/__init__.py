"""The synthetic digit task of the embedded default: generator, verifier, warm-up format,
and the tiny supervised base model (tokenizer + HF model) RL starts from."""

from megatron_rl.rewards.digit_answer import DigitAnswerVerifier, final_answer
from megatron_rl.tasks.digits import ANSWER_SPACE, TASKS, DigitTask, TaskExample, get_task

__all__ = [
    "ANSWER_SPACE",
    "TASKS",
    "DigitTask",
    "TaskExample",
    "get_task",
    "DigitAnswerVerifier",
    "final_answer",
]
