"""The lines of the `sglang-eagle3-hidden-debug` patch set, parsed. Pure: a line's text in, a record out.

The patch logs (behind SGLang's own `[time TPn]` prefix):
    [orch-eagle3-debug] STAGE[ layer_input=N] call=C part=I/K shape=(A, B) dtype=torch.bfloat16 absmean=0.1234 sample=[...]
    [orch-eagle3-debug] STAGE call=C part=I/K None
"""

from __future__ import annotations

import re
from typing import Any

PREFIX = "[orch-eagle3-debug]"

_LINE = re.compile(
    r"\[orch-eagle3-debug\] (?P<stage>\S+)(?: layer_input=(?P<layer>\d+))? call=(?P<call>\d+)"
    r" part=(?P<part>\d+)/(?P<parts>\d+)"
    r"(?: shape=(?P<shape>\([\d, ]*\)) dtype=(?P<dtype>\S+) absmean=(?P<absmean>[-+\w.]+)| (?P<none>None))"
)


def parse(text: str) -> dict[str, Any] | None:
    """The line's stage, layer, call, part, shape, dtype and mean |x| (None for a None tensor), or None."""
    m = _LINE.search(text)
    if m is None:
        return None
    absmean: float | None = None
    if m.group("absmean") is not None:
        try:
            absmean = float(m.group("absmean"))  # %.5g may print nan or inf: kept, they are the finding
        except ValueError:
            return None
    return {
        "stage": m.group("stage"),
        "layer": int(m.group("layer")) if m.group("layer") is not None else None,
        "call": int(m.group("call")),
        "part": int(m.group("part")),
        "parts": int(m.group("parts")),
        "shape": m.group("shape") if m.group("shape") is not None else "None",
        "dtype": m.group("dtype").removeprefix("torch.") if m.group("dtype") else None,
        "absmean": absmean,
    }
