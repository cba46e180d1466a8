"""`orch logs` on a terminal: escape sequences in a log (window title, OSC 52 clipboard, screen clear)
never reach it, while text, tabs and newlines do (a bare '\\r' is shown as a line break); a pipe gets the log
byte for byte."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time

from hypothesis import given, settings
from hypothesis import strategies as st
from orchtest import FAST, Orch

from orchestrator.logparse.text import TerminalText, terminal_safe

HOSTILE = (
    "title\x1b]0;pwned title\x07|"
    "clip\x1b]52;c;cHduZWQ=\x1b\\|"
    "clear\x1b[2J\x1b[H|"
    "dcs\x1bPq#0;2;0;0;0\x1b\\|"
    "c1\u009b31m|bell\x07|bs\x08|nul\x00|unterminated\x1b]2;no end\n"
)
SHOWN = "title|clip|clear|dcs|c131m|bell|bs|nul|unterminated\n"
# what a terminal could act on: any C0 control but tab, newline and '\r'; DEL; C1
UNSAFE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def test_escape_sequences_go_and_text_stays():
    assert terminal_safe(HOSTILE) == SHOWN
    bar = "Loading:  50%|#####     | 5/10 [00:05<00:05]\rLoading: 100%|##########| 10/10\n\tdone\n"
    assert terminal_safe(bar) == bar
    assert terminal_safe("\x1b[1;31mERROR\x1b[0m: x") == "ERROR: x"


def test_chunks_split_anywhere_give_the_same_text():
    data = (HOSTILE + "d\u00e9j\u00e0 vu \u2588\n").encode()
    whole = terminal_safe(data.decode())
    for size in (1, 2, 3, 7):
        screen = TerminalText()
        shown = "".join(screen.feed(data[i:i + size]) for i in range(0, len(data), size)) + screen.feed(b"", True)
        assert shown == whole, size


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.binary(max_size=20), st.sampled_from(
    [b"\x1b", b"\x1b[", b"\x1b]", b"\x1bP", b"\x07", b"\x1b\\", b"\xc2\x9b", b"\r", b"\n", b"\xff", b"52;c;"])),
    max_size=30))
def test_nothing_a_terminal_acts_on_gets_through(chunks):
    screen = TerminalText()
    shown = "".join(screen.feed(c) for c in chunks) + screen.feed(b"", True)
    assert not UNSAFE.search(shown)


def on_a_terminal(orch: Orch, *args: str, timeout: float = 60) -> bytes:
    """Run orch with stdout on a pseudo-terminal; everything it wrote there."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", *args], env=orch.env, stdout=follower,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    os.close(follower)
    out = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([leader], [], [], 0.5)[0]:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # EIO: the process closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
    finally:
        os.close(leader)
        proc.wait(timeout=10)
    assert proc.returncode == 0, proc.stderr.read()
    return out


def test_orch_logs_on_a_terminal_and_into_a_pipe(tmp_path):
    orch = Orch(tmp_path / "ws")
    (tmp_path / "hostile.txt").write_bytes(HOSTILE.encode())
    res = orch("run", "command", "--set", f"cmd=cat {tmp_path / 'hostile.txt'}", *FAST)
    assert res.returncode == 0, res.stderr
    assert orch("logs", "1", check=0).stdout == HOSTILE  # a pipe: the log as it is
    shown = on_a_terminal(orch, "logs", "1")
    assert shown.decode().replace("\r\n", "\n") == SHOWN


def test_orch_logs_follow_on_a_terminal(tmp_path):
    """-f reads the log along as it grows: the sequences arrive after the first read."""
    orch = Orch(tmp_path / "ws")
    (tmp_path / "hostile.txt").write_bytes(HOSTILE.encode())
    cmd = f"cmd=echo started; sleep 2; cat {tmp_path / 'hostile.txt'}; sleep 1; echo ended"
    res = orch("run", "command", "--set", cmd, "--detach", *FAST)
    assert res.returncode == 0, res.stderr
    shown = on_a_terminal(orch, "logs", "1", "-f").decode().replace("\r\n", "\n")
    assert shown == "started\n" + SHOWN + "ended\n", repr(shown)
