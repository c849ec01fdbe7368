"""An argparse parser whose errors are one line and exit 2, as every bad input of the CLI is."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from megatron_rl.launch.exit_codes import CONFIG_ERROR


class OneLineParser(argparse.ArgumentParser):
    """argparse's usage block replaced by one line naming the error and where help is."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(CONFIG_ERROR)
