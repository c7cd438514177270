"""CPU: ember's threads carry their Python names at the OS level (what libember's divergence line,
`top -H` and core dumps show), cut to the 15 bytes Linux keeps."""

from __future__ import annotations

import threading
from pathlib import Path

from ember.runtime.thread_names import name_this_thread


def _os_name(tid: int) -> str:
    return Path(f"/proc/self/task/{tid}/comm").read_text().strip()


def test_a_thread_takes_its_python_name_cut_to_what_linux_keeps() -> None:
    seen: dict[str, str] = {}

    def run() -> None:
        seen["ok"] = str(name_this_thread())
        seen["os"] = _os_name(threading.get_native_id())

    t = threading.Thread(target=run, name="ember-reconstruct")
    t.start()
    t.join()
    assert seen == {"ok": "True", "os": "ember-reconstru"}
    assert _os_name(threading.get_native_id()) != "ember-reconstru"  # the caller's own name is untouched
