import pytest

from megatron_rl.tasks import get_task
from megatron_rl.tasks.chat_format import training_text
from megatron_rl.tasks.tokenizer import train_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    """A real HF fast tokenizer with a chat template (the tiny base's, trained in ~0.1 s)."""
    examples = get_task("digits_max").generate(200, seed=0)
    return train_tokenizer(["".join(training_text(e)) for e in examples])
