"""Test helpers shared by the test suites of every package (torchrun launches, tiny models)."""
