"""Test-suite settings: under CI (CI set in the environment) hypothesis draws a fixed sequence of examples, so a
submission is judged on the same cases every run; locally it explores new random cases each run."""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
