"""Installed versions compared as PEP 440 orders them: what a patch set's `versions` clauses accept."""

import re

VERSION_RE = re.compile(
    r"^v?(\d+(?:\.\d+)*)"
    r"(?:[-_.]?(a|b|rc|alpha|beta|c|pre|preview)[-_.]?(\d*))?"
    r"(?:[-_.]?(post|rev|r)[-_.]?(\d*)|-(\d+))?"
    r"(?:[-_.]?(dev)[-_.]?(\d*))?"
    r"(?:\+[a-z0-9.\-_]+)?$",
    re.IGNORECASE,
)
PRE_RANK = {"a": 0, "alpha": 0, "b": 1, "beta": 1, "c": 2, "rc": 2, "pre": 2, "preview": 2}
INFINITY = 1 << 62


def version_key(text):
    """A sort key ordering versions as PEP 440 does (dev < pre < final < post; local labels ignored)."""
    m = VERSION_RE.match(text.strip())
    if not m:
        raise ValueError(f"not a version: {text!r}")
    release = [int(p) for p in m.group(1).split(".")]
    while len(release) > 1 and release[-1] == 0:
        release.pop()  # 0.5.23 == 0.5.23.0
    pre_letter, pre_n = m.group(2), m.group(3)
    post_n = m.group(5) if m.group(4) else m.group(6)
    has_post = bool(m.group(4) or m.group(6))
    has_dev = bool(m.group(7))
    if pre_letter:
        pre = (0, PRE_RANK[pre_letter.lower()], int(pre_n or 0))
    elif has_dev and not has_post:
        pre = (-1, 0, 0)  # 1.0.dev1 comes before 1.0a1
    else:
        pre = (1, 0, 0)
    post = int(post_n or 0) if has_post else -1
    dev = int(m.group(8) or 0) if has_dev else INFINITY
    return (tuple(release), pre, post, dev)


def version_matches(version, spec):
    """True when `version` satisfies every comma-separated clause of `spec` (==, !=, >=, <=, >, <)."""
    ops = {
        "==": lambda a, b: a == b,
        "!=": lambda a, b: a != b,
        ">=": lambda a, b: a >= b,
        "<=": lambda a, b: a <= b,
        ">": lambda a, b: a > b,
        "<": lambda a, b: a < b,
    }
    have = version_key(version)
    for clause in spec.split(","):
        clause = clause.strip()
        if not clause:
            continue
        m = re.match(r"^(==|!=|>=|<=|>|<)\s*(\S+)$", clause)
        if not m:
            raise ValueError(f"unsupported version clause: {clause!r}")
        if not ops[m.group(1)](have, version_key(m.group(2))):
            return False
    return True
