"""A SAVE or LOAD that does not end logs every thread's stack (`ember.runtime.stacks`)."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import time
from ember.runtime.stacks import dumped_while_stuck
def waiting_in_save():
    time.sleep(1.6)
with dumped_while_stuck():
    waiting_in_save()
with dumped_while_stuck():
    pass
time.sleep(1.2)  # after the block: no more dumps
"""


def _run(after: str) -> str:
    env = {**os.environ, "EMBER_STACKS_AFTER_S": after}
    p = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                       timeout=60, check=True)
    return p.stderr


def test_a_block_still_running_names_where_it_waits_until_it_ends() -> None:
    err = _run("0.5")
    assert "waiting_in_save" in err
    assert 2 <= err.count("Timeout (") <= 4  # every 0.5 s for 1.6 s, none after the block


def test_zero_turns_it_off() -> None:
    assert "Timeout (" not in _run("0")
