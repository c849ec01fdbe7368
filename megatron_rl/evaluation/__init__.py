"""Held-out evaluation: named eval sets generated on the job's own vLLM engines between
steps, scored with the task's reward, reported as avg@n accuracy and unbiased pass@k."""

from megatron_rl.evaluation.metrics import CORRECT_SCORE, PromptResult, pass_at_k, set_metrics

__all__ = ["CORRECT_SCORE", "PromptResult", "pass_at_k", "set_metrics"]
