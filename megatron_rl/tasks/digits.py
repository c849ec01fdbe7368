"""The synthetic digit task of the embedded default: a prompt of digits, a one-digit answer.

Why this task: the answer space is ten digits, so a policy that answers at random is
right 10% of the time (RL gets signal from the first step), while answering well needs
the prompt's digits (chance is far from perfect). ``reasoning=True`` puts the running
values of the computation before the answer, so response length follows the number of
digits in the prompt (for T-PPO windows and length-dependent recipes).

Text format (the verifier and the warm-up data share it)::

    prompt:   "max of 3 7 1 4"          ("sum mod 10 of ..." for op="sum_mod10")
    solution: "Answer: 7"               (reasoning=False)
              "3 7 7 7 Answer: 7"       (reasoning=True: running max after each digit)
              "3 max(3,7)=7 max(7,1)=7 max(7,4)=7 Answer: 7"    (reasoning="work")

``reasoning="work"`` writes every step out, so the answer is several times as long as the
prompt, as in reasoning RL, where rollouts are bound by their decode steps.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Callable, Optional, Sequence

# op name -> (prompt prefix, step of the running computation)
_OPS: dict[str, tuple[str, Callable[[int, int], int]]] = {
    "max": ("max of", max),
    "min": ("min of", min),
    "sum_mod10": ("sum mod 10 of", lambda acc, d: (acc + d) % 10),
}
_WORK = {"max": "max({a},{d})={v}", "min": "min({a},{d})={v}", "sum_mod10": "{a}+{d}={v}"}
"""How ``reasoning="work"`` writes one step: running value ``a``, next digit ``d``, result ``v``."""
REASONING = (False, True, "work")
VERIFIERS = ("digits", "digit_chain")
_FIRST_FIELDS = ("op", "min_digits", "max_digits", "reasoning")
ANSWER_SPACE = tuple(str(d) for d in range(10))


@dataclasses.dataclass(frozen=True)
class TaskExample:
    """One prompt with its ground truth and the reference solution text."""

    prompt: str
    answer: str
    solution: str
    digits: tuple[int, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DigitTask:
    """A family of digit prompts; every field changes what is generated."""

    op: str = "max"
    """What the answer is: one of ``max``, ``min``, ``sum_mod10`` of the prompt's digits."""
    min_digits: int = 3
    """Fewest digits in a prompt."""
    max_digits: int = 5
    """Most digits in a prompt."""
    reasoning: bool | str = False
    """Write the running values before the answer (response length grows with the prompt);
    ``"work"``: write each step as ``max(a,d)=v``."""
    chained_answer: bool = False
    """The warm-up's random chains are consistent in form: each step starts from the value
    the step before wrote, and the answer is the chain's last value. The warm-up then
    teaches how the scratchpad is used, still none of its arithmetic."""
    uniform_answer: bool = False
    """Draw the answer first, uniformly, then digits that give it: for ``max`` the digits are
    at most the answer and one of them is it. The max of many uniform digits is 9 more often
    than not, so a policy that always answers 9 would score well without reading the prompt;
    with uniform answers every answer is right 1 time in 10."""
    verifier: str = "digits"
    """The reward (megatron_rl.rewards.REWARDS) that scores the task: ``digits`` grades the
    final answer, ``digit_chain`` also the chain (one step per prompt digit)."""

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ValueError(f"DigitTask.op={self.op!r} is not known; allowed: {sorted(_OPS)}")
        if self.reasoning not in REASONING:
            raise ValueError(f"DigitTask.reasoning={self.reasoning!r} is not known; allowed: {REASONING}")
        if (self.chained_answer or self.verifier == "digit_chain") and self.reasoning != "work":
            raise ValueError("DigitTask.chained_answer and the digit_chain verifier need reasoning='work'")
        if self.verifier not in VERIFIERS:
            raise ValueError(f"DigitTask.verifier={self.verifier!r} is not known; allowed: {list(VERIFIERS)}")
        if self.uniform_answer and self.op != "max":
            raise ValueError(f"DigitTask.uniform_answer is defined for op='max' only, not {self.op!r}")
        if not 1 <= self.min_digits <= self.max_digits <= 32:
            raise ValueError(
                f"DigitTask needs 1 <= min_digits <= max_digits <= 32, got "
                f"min_digits={self.min_digits}, max_digits={self.max_digits}"
            )

    @property
    def chance_accuracy(self) -> float:
        """Accuracy of a well-formed answer drawn uniformly from the answer space."""
        return 1.0 / len(ANSWER_SPACE)

    def seed_key(self) -> str:
        """The task's part of its generator's seed: the dataclass repr of the first four fields
        (``_FIRST_FIELDS``) and of every other field that differs from its default. A task
        that sets none of the others draws its prompts from the plain four-field repr, the
        key its cached bases and the embedded default's reference curve were built from."""
        shown = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if f.name in _FIRST_FIELDS or getattr(self, f.name) != f.default
        ]
        return f"{type(self).__name__}({', '.join(shown)})"

    def reference(self, example: TaskExample) -> str:
        """What the prompt files' ``answer`` field holds: the answer, or for the chain
        verifier the reference solution (its digits and final answer)."""
        return example.solution if self.verifier == "digit_chain" else example.answer

    def running_values(self, digits: Sequence[int]) -> list[int]:
        step = _OPS[self.op][1]
        values = [digits[0]]
        for d in digits[1:]:
            values.append(step(values[-1], d))
        return values

    def prompt(self, digits: Sequence[int]) -> str:
        return f"{_OPS[self.op][0]} " + " ".join(str(d) for d in digits)

    def answer(self, digits: Sequence[int]) -> str:
        return str(self.running_values(digits)[-1])

    def solution(
        self,
        digits: Sequence[int],
        answer: Optional[str] = None,
        steps: Optional[Sequence[int]] = None,
    ) -> str:
        """The response text; ``answer``/``steps`` override the true ones (warm-up labels)."""
        answer = self.answer(digits) if answer is None else answer
        if not self.reasoning:
            return f"Answer: {answer}"
        steps = self.running_values(digits) if steps is None else steps
        if self.reasoning == "work":
            steps = [steps[0], *(_WORK[self.op].format(a=a, d=d, v=v) for a, d, v in zip(steps, digits[1:], steps[1:]))]
        return " ".join(str(v) for v in steps) + f" Answer: {answer}"

    def example(self, digits: Sequence[int]) -> TaskExample:
        digits = tuple(int(d) for d in digits)
        return TaskExample(self.prompt(digits), self.answer(digits), self.solution(digits), digits)

    def sample_digits(self, rng: random.Random) -> tuple[int, ...]:
        n = rng.randint(self.min_digits, self.max_digits)
        if not self.uniform_answer:
            return tuple(rng.randrange(10) for _ in range(n))
        answer = rng.randrange(10)
        digits = [rng.randrange(answer + 1) for _ in range(n)]
        digits[rng.randrange(n)] = answer
        return tuple(digits)

    def generate(self, n: int, seed: int) -> list[TaskExample]:
        """``n`` examples, the same for the same ``(task, n, seed)`` on every machine."""
        rng = random.Random(f"{self.seed_key()}-{seed}")  # string seeds hash deterministically
        return [self.example(self.sample_digits(rng)) for _ in range(n)]


TASKS: dict[str, DigitTask] = {
    "digits_max": DigitTask(op="max"),
    # digits_max with answers uniform over the ten digits: "always 9" (right on 28-41 % of
    # digits_max's prompts of 3-5 digits) is right on a tenth, so a policy cannot climb by
    # the shortcut (the reward-model examples, docs/recipes.md).
    "digits_max_uniform": DigitTask(op="max", uniform_answer=True),
    "digits_sum": DigitTask(op="sum_mod10"),
    "digits_max_steps": DigitTask(op="max", min_digits=2, max_digits=8, reasoning=True),
    "digits_sum_steps": DigitTask(op="sum_mod10", min_digits=2, max_digits=8, reasoning=True),
    # Every step written out: answers several times as long as the prompt (the async bench's
    # generation-heavy workload).
    "digits_max_work": DigitTask(op="max", min_digits=8, max_digits=16, reasoning="work"),
    # The reasoning task of the learning benchmarks (docs/claims.md): a running max written
    # step by step over 3-20 digits (responses of about 20-150 tokens), answers uniform over
    # the ten digits, and the chain graded with the answer (rewards/digit_chain.py).
    "digits_max_chain": DigitTask(
        op="max",
        min_digits=3,
        max_digits=20,
        reasoning="work",
        chained_answer=True,
        uniform_answer=True,
        verifier="digit_chain",
    ),
}
# The same prompts, answers and grading from a colder base (tasks/base_model.py's
# TASK_BASE_SETTINGS): the chain task with headroom past 100 steps (docs/claims.md).
TASKS["digits_max_chain_cold"] = TASKS["digits_max_chain"]


def get_task(name: str) -> DigitTask:
    if name not in TASKS:
        raise ValueError(f"task {name!r} is not known; allowed: {sorted(TASKS)}")
    return TASKS[name]
