"""orch's side on a host: a stdlib-only package (Python 3.8 or newer) shipped to the host as one archive
checked by its sha256 (boot.py), run as one agent per watcher connection speaking JSON lines (protocol.py),
and as each job's wrapper (jobs.py). Nothing here imports anything outside the standard library."""
