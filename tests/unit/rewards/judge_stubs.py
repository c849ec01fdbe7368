"""Judges for test_judge.py's worker pool: a scripted stand-in for the judge's engine (the
pool, the timeout, the replacement and the verdicts are what is tested, not vLLM). A
prompt holding "sleep" hangs the worker, "die" kills it, "garbage" gets no verdict, "slow"
takes a tenth of a second."""

import os
import time


class ScriptedJudge:
    def __init__(self, correct: str):
        self.correct = correct

    def __call__(self, prompts):
        answers = []
        for prompt in prompts:
            if "sleep" in prompt:
                time.sleep(60)
            if "slow" in prompt:
                time.sleep(0.1)
            if "die" in prompt:
                os._exit(3)
            answers.append("?!" if "garbage" in prompt else "Yes." if self.correct in prompt else "no")
        return answers
