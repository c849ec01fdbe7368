"""The tool task's warm-up trains on the very tokens an episode holds: the call turn parses
as a python call of the right product, and the conversation after it is the prompt, the
sampled turn and the observation tokens the episode driver appends."""

from megatron_rl.environments.episode import ObservationEncoder, encode_prompt
from megatron_rl.environments.tool_calls import HermesParser, ToolCall
from megatron_rl.environments.tools import PYTHON
from megatron_rl.tasks.chat_format import END
from megatron_rl.tasks.tokenizer import train_tokenizer
from megatron_rl.tasks.tool_products import Product, products, warmup_pairs


def test_the_warm_up_pairs_are_the_episodes_tokens():
    items = products(50, seed=0)
    pairs = warmup_pairs(items, call_fraction=0.5, seed=0)
    tokenizer = train_tokenizer([p + c for p, c in pairs], 512, individual_digits=True)
    item = Product(347, 812)
    (call,) = HermesParser().parse(item.call_turn(), {"python": PYTHON})
    assert call == ToolCall("python", {"code": "print(347 * 812)"}) and item.answer == str(347 * 812)

    prompt = encode_prompt(tokenizer, item.messages(called=False), (PYTHON,))
    turn = tokenizer(item.call_turn() + END, add_special_tokens=False).input_ids
    observation = ObservationEncoder(tokenizer).encode([item.messages(called=True)[-1]])
    after = [p for p, c in warmup_pairs([item], call_fraction=1.0, seed=0)][1]
    assert tokenizer(after, add_special_tokens=False).input_ids == prompt + turn + observation
    assert tokenizer.convert_ids_to_tokens(tokenizer("281764", add_special_tokens=False).input_ids) == list("281764")

    firsts = [c for p, c in pairs[::2]]
    assert {c.startswith("<tool_call>") for c in firsts} == {True, False}
    assert all(c == f"Answer: {i.a}{END}" for c, i in zip(firsts, items) if not c.startswith("<tool_call>"))
    assert all(c == f"Answer: {i.answer}{END}" for c, i in zip([c for p, c in pairs[1::2]], items))
