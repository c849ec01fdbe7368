"""The digit task's own preference pairs: the chosen answer is what the task's verifier
grades right, the rejected one what it grades wrong (a wrong digit, the digit without the
answer's form, the working without an answer), on prompts of the base's splits."""

from megatron_rl.data import read_pairs
from megatron_rl.rewards.digit_answer import DigitAnswerVerifier
from megatron_rl.tasks.base_model import BaseModelSettings
from megatron_rl.tasks.digits import get_task
from megatron_rl.tasks.pairs import write_task_pairs


def test_the_chosen_answer_is_right_and_the_rejected_wrong_by_the_tasks_verifier(tmp_path):
    settings = BaseModelSettings(task="digits_max", num_train_prompts=200, num_eval_prompts=50, seed=3)
    train_path, held_out_path = write_task_pairs(settings, tmp_path)
    train, held_out = read_pairs(train_path), read_pairs(held_out_path)
    assert (len(train), len(held_out)) == (200, 50)
    assert not {p.chosen[0]["content"] for p in train} & {p.chosen[0]["content"] for p in held_out}
    task, verifier = get_task("digits_max"), DigitAnswerVerifier()
    wrong, kinds = [], set()
    for pair in train + held_out:
        prompt = pair.chosen[0]["content"]
        truth = task.answer([int(d) for d in prompt.split()[2:]])  # "max of 3 7 1" -> its digits
        assert pair.rejected[0] == pair.chosen[0]
        assert verifier.grade(pair.chosen[-1]["content"], truth)[0] == 1.0
        assert verifier.grade(pair.rejected[-1]["content"], truth)[0] == 0.0
        rejected = pair.rejected[-1]["content"]
        if rejected.startswith("Answer: "):
            kinds.add("wrong")
            wrong.append(rejected[-1])
        else:
            kinds.add("bare" if rejected == truth else "unfinished")
    assert len(set(wrong)) == 10  # every digit is somebody's wrong answer
    assert kinds == {"wrong", "bare", "unfinished"}
    assert write_task_pairs(settings, tmp_path / "again") and (tmp_path / "again" / train_path.name).read_text() == (
        train_path.read_text()
    )
