"""Secrets in a run's `env`: which names look secret, and a spec with their values masked. A leaf: the
store masks what it keeps with it, the config layer what it shows."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import parse_qsl

# Secrets in `env`: a value whose name looks secret, or is listed in `secret_env`, or that holds a
# credential in a URL, is stored and shown as MASK (the database, runs/<id>/spec.json, status, the
# dashboard, compare, reports, a dry run); the job gets the real one. A run started again from its record
# finds MASK there, so MASK in `env` means "the value of this variable in orch's own environment", taken
# when the run is built (`build`). A whole value is masked, never a part: MASK alone stands for a value.
MASK = "***"
# One of the name's `_`-separated words ends in one of these (a plural, a number after it): HF_TOKEN,
# WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, PGPASSWORD, APIKEY2; not TOKENIZERS_PARALLELISM or KEYBOARD, which
# only start with one.
_SECRET_WORD = re.compile(r"(?:TOKEN|KEY|SECRET|PASSWORD|PASSWD|PASSPHRASE)S?\d*$", re.IGNORECASE)
# Short ones only as a whole word, or they would catch COMPAT, BYPASS, COMPASS: GITHUB_PAT, DB_PASS, PWD2.
_SECRET_NAME = re.compile(r"(?:PAT|PASS|PWD)\d*$", re.IGNORECASE)
# A name whose last word says it names where a secret is, not the secret: HF_TOKEN_PATH, SSL_KEY_FILE.
_WHERE_WORD = re.compile(r"(?:PATH|FILE|DIR|LOCATION)S?$", re.IGNORECASE)
# A plural after a word that counts names a number of them, not a secret: MAX_TOKENS, MAX_NEW_TOKENS, NUM_KEYS.
_COUNT_WORDS = frozenset({"MAX", "MIN", "NUM", "N", "NEW", "TOTAL", "BATCH", "PREFILL", "DECODE"})
# Shell's own variables: PWD is the working directory, not a password.
_NOT_SECRET = frozenset({"PWD", "OLDPWD"})
# A URL anywhere in a value (`--db=postgres://...` too); one whose user part carries a password, or any
# user part over http(s), where it is a token (https://ghp_...@github.com), not a login name (ssh://git@).
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://\S+")
_USER_PASSWORD = re.compile(r"[^:]+://[^\s/?#@:]*:[^\s/?#]+@|https?://[^\s/?#@]+@", re.IGNORECASE)


def looks_secret(name: str) -> bool:
    words = name.split("_")
    if name.upper() in _NOT_SECRET or _WHERE_WORD.fullmatch(words[-1]):
        return False
    return any((_SECRET_WORD.search(word) and not counted(words, i)) or _SECRET_NAME.fullmatch(word)
               for i, word in enumerate(words))


def counted(words: list[str], i: int) -> bool:
    return words[i].upper() in ("TOKENS", "KEYS") and i > 0 and words[i - 1].upper() in _COUNT_WORDS


def holds_credential(value: str) -> bool:
    """A URL in the value with a password in it (postgres://user:pw@host/db), a token as its user
    (https://TOKEN@host/...) or a query parameter whose name looks secret (https://host/hook?token=...)."""
    for url in _URL.findall(value):
        if _USER_PASSWORD.match(url):
            return True
        query = url.partition("?")[2].partition("#")[0]
        if any(v and looks_secret(k.replace("-", "_")) for k, v in parse_qsl(query, keep_blank_values=True)):
            return True
    return False


def is_secret(name: str, value: Any, marked: Iterable[str] = ()) -> bool:
    """Whether `name=value` is shown masked (an empty value hides nothing: it stays)."""
    if value in ("", None):
        return False
    return name in marked or looks_secret(name) or (isinstance(value, str) and holds_credential(value))


def masked_env(env: Mapping[str, Any], marked: Iterable[str] = ()) -> dict[str, Any]:
    """`env` with the values of secrets replaced by MASK."""
    marked = set(marked)
    return {k: MASK if is_secret(k, v, marked) else v for k, v in env.items()}


def masked_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """A spec as plain values (a sweep file's `[spec]`, a stored spec) with its secrets masked."""
    env, marked = values.get("env"), values.get("secret_env")
    if not isinstance(env, Mapping):
        return dict(values)
    names = [m for m in marked if isinstance(m, str)] if isinstance(marked, list) else []
    return {**values, "env": masked_env(env, names)}


# --- secrets in a command line ---------------------------------------------------------------------------------
# A flag's words as an env name's: `--hf-token`, `--api_key`, `-password` read as HF_TOKEN, API_KEY, PASSWORD.
_FLAG = re.compile(r"-{1,2}([A-Za-z][A-Za-z0-9_.-]*)")
# One word as the shell reads it: quoted ('...', "...", $'...') or bare, up to a space or an operator.
_WORD = r"""(?:'[^']*'|"(?:[^"\\]|\\.)*"|\$'(?:[^'\\]|\\.)*'|[^\s;|&<>'"])+"""
# A flag and its value (`--api-key K`, `--hf-token=K`), or an assignment (`HF_TOKEN=K cmd`, `export K=V`).
_FLAG_VALUE = re.compile(r"(?<![^\s;|&(])(-{1,2}[A-Za-z][A-Za-z0-9_.-]*)(=|[ \t]+)(?!-)(" + _WORD + ")")
_ASSIGNED = re.compile(r"(?<![^\s;|&(])([A-Za-z_][A-Za-z0-9_]*)=(" + _WORD + ")")


def _flag_looks_secret(flag: str) -> bool:
    m = _FLAG.fullmatch(flag)
    return m is not None and looks_secret(re.sub(r"[-.]", "_", m.group(1)))


def _hides(value: str) -> bool:
    """A flag's value worth masking: a number is a count (`--speculative-num-draft-tokens 4`), not a secret."""
    return value not in ("", MASK) and not re.fullmatch(r"[\d.]+", value.strip("'\""))


def masked_argv(argv: Iterable[str], known: Iterable[str] = ()) -> list[str]:
    """`argv` with its secrets masked as the environment's are: the value after (or `=` in) a flag whose name
    looks secret (`--api-key K`, `--hf-token=K`), an assignment to a secret-looking name, a URL with a
    credential, and any `known` secret value (an env secret written out on the line too)."""
    words = list(argv)
    found = list(known)  # a secret seen once is masked wherever else the line repeats it
    out = []
    for i, word in enumerate(words):
        flag, eq, value = word.partition("=")
        assigned = re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", flag) and looks_secret(flag)
        if i and _flag_looks_secret(words[i - 1]) and not word.startswith("-") and _hides(word):
            found.append(word)
        elif eq and ((_flag_looks_secret(flag) and _hides(value)) or (assigned and value)):
            found.append(value)
        out.append(_mask_urls(word))
    return [_mask_known(word, found) for word in out]


def masked_command(command: str, known: Iterable[str] = ()) -> str:
    """A shell command (or a script of them) with its secrets masked where they stand, as masked_argv masks
    an argv; its shape is kept (the rest of the text is left byte for byte)."""
    found = list(known)  # a secret seen once is masked wherever else the line repeats it

    def flag(m: re.Match[str]) -> str:
        if not (_flag_looks_secret(m.group(1)) and _hides(m.group(3))):
            return m.group(0)
        found.append(_unquoted(m.group(3)))
        return m.group(1) + m.group(2) + MASK

    def assigned(m: re.Match[str]) -> str:
        if not (looks_secret(m.group(1)) and m.group(2)):
            return m.group(0)
        found.append(_unquoted(m.group(2)))
        return f"{m.group(1)}={MASK}"

    text = _ASSIGNED.sub(assigned, _FLAG_VALUE.sub(flag, command))
    return _mask_known(_mask_urls(text), found)


def _unquoted(word: str) -> str:
    import shlex

    try:
        return "".join(shlex.split(word)) or word
    except ValueError:
        return word


def _mask_urls(text: str) -> str:
    return _URL.sub(lambda m: MASK if holds_credential(m.group(0)) else m.group(0), text)


def _mask_known(text: str, known: Iterable[str]) -> str:
    """Each known secret replaced where it stands as a whole word (after a space, a quote, `=` or `$`; before
    a space, a quote or `;`), as written or shell-quoted: a short one never eats a part of another word."""
    import shlex

    forms = {form for secret in known if secret and secret != MASK for form in (shlex.quote(secret), secret)}
    for form in sorted(forms, key=len, reverse=True):  # the longest first: a part never unmasks a whole
        text = re.sub(r"(?<![^\s'\"=$])" + re.escape(form) + r"(?![^\s'\";])", MASK, text)
    return text
