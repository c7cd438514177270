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


BOUNDED = """
import sys, time
from ember.runtime.stacks import dumped_while_stuck, exit_if_stuck
def waiting_for_a_peer(s):
    time.sleep(s)
with dumped_while_stuck():
    with exit_if_stuck(1.0):
        waiting_for_a_peer(0.1)
    print("canary done", flush=True)
    waiting_for_a_peer(1.3)  # the enclosing dumps go on after the bounded block (every 0.5 s)
with exit_if_stuck(0.5):
    pass
time.sleep(0.8)  # neither the bound nor the dumps outlive their blocks
print("serving", flush=True)
with exit_if_stuck(float(sys.argv[1])):
    waiting_for_a_peer(30)
print("never", flush=True)
"""


def _bounded(limit: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "EMBER_STACKS_AFTER_S": "0.5"}
    return subprocess.run([sys.executable, "-c", BOUNDED, limit], env=env, capture_output=True, text=True,
                          timeout=60, check=False)


def test_a_block_waiting_on_peers_past_its_limit_ends_the_process_naming_where_it_waited() -> None:
    """A rank whose peer never joins the canary's collective ends, stacks first, instead of waiting
    for NCCL's timeout (the crash marker then makes the next start native)."""
    p = _bounded("0.5")
    assert p.returncode == 1 and "canary done" in p.stdout and "serving" in p.stdout
    assert "never" not in p.stdout
    dumps = p.stderr.split("Timeout (")[1:]
    assert 3 <= len(dumps) <= 4  # 2 or 3 of the enclosing block's after the bounded one, then the end
    assert all("line 10 in <module>" in d for d in dumps[:-1])  # the wait after the canary
    assert "waiting_for_a_peer" in dumps[-1] and "line 16 in <module>" in dumps[-1]  # where it waited


def test_no_limit_without_a_bound() -> None:
    p = subprocess.run([sys.executable, "-c", "from ember.runtime.stacks import exit_if_stuck\n"
                        "import time\nwith exit_if_stuck(0):\n    time.sleep(0.6)\nprint('ok')"],
                       capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 0 and p.stdout.strip() == "ok" and "Timeout (" not in p.stderr
