"""The critic: Megatron's GPT backbone with a scalar value head instead of the LM head."""

from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region


class ValueHead(torch.nn.Module):
    """Per-token linear map hidden -> 1, replicated over TP ranks.

    It stands where GPTModel calls ``self.output_layer(hidden, weight=, runtime_gather_output=)``
    and returns ``(values, None)`` like the LM head, so GPTModel's forward (and every
    pipeline schedule) works unchanged. Under sequence parallelism each TP rank holds a
    shard of the sequence: values are computed on the shard, then gathered with a split
    (not a reduce-scatter) in backward, and the head's weight gradient is summed over TP by
    ``finalize_model_grads`` because the weight is marked ``sequence_parallel``.
    """

    def __init__(self, config, tp_group):
        super().__init__()
        self.sequence_parallel = config.sequence_parallel
        self.tp_group = tp_group
        self.weight = torch.nn.Parameter(torch.empty(1, config.hidden_size, dtype=config.params_dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=config.params_dtype))
        with torch.no_grad():
            config.init_method(self.weight)
        for param in (self.weight, self.bias):
            param.sequence_parallel = config.sequence_parallel

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        values = torch.nn.functional.linear(hidden_states, self.weight, self.bias)  # [s, b, 1]
        if self.sequence_parallel:
            values = gather_from_sequence_parallel_region(
                values, tensor_parallel_output_grad=False, group=self.tp_group
            )
        return values, None


class CriticGPTModel(GPTModel):
    """GPTModel whose last stage outputs one value per token: forward returns [b, s, 1]."""

    def __init__(self, *args, **kwargs):
        kwargs["share_embeddings_and_output_weights"] = False
        super().__init__(*args, **kwargs)
        if self.post_process:
            self.output_layer = ValueHead(self.config, self.pg_collection.tp)


def freeze_bias(chunks) -> None:
    """Take the value head's bias out of training (a reward model's, before wrapping).

    A Bradley-Terry loss reads r_chosen - r_rejected only, so its gradient wrt the bias is
    zero in exact arithmetic; in fp32 it is a rounding residue (about 6e-8: the sum of
    +g and -g in another order), which Adam divides by its own magnitude into steps of
    about the learning rate. Frozen, the bias stays at its zero init (and the HF export,
    whose score layer has no bias, keeps every score)."""
    for chunk in chunks:
        head = getattr(chunk, "output_layer", None)  # the last pipeline stage only
        if isinstance(head, ValueHead):
            head.bias.requires_grad_(False)
