"""The host side's entry: `wrap` (a job's wrapper), or the agent serving one watcher on stdin and stdout."""

import signal

from . import patcher
from .jobs import wrap
from .protocol import Agent


def main(argv):
    if argv[:1] == ["patch"]:  # under the run's python, its request on stdin (patcher.py)
        return patcher.main()
    if argv[:1] == ["wrap"]:
        opts = argv[1:]
        given = dict(zip(opts[::2], opts[1::2])) if "--detach" not in opts else {}
        return wrap("--detach" in opts, given.get("--dir"), given.get("--run"))
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # the channel gone: end quietly
    try:
        Agent().serve()
    except (BrokenPipeError, KeyboardInterrupt):
        pass
    return 0
