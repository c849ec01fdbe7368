from megatron_rl.cli import entry

entry()
