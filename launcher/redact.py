"""Secrets out of every record the launcher writes or sends (launch.json, tracker params and tags, error
lines): a value whose name says it is secret, and credentials inside URLs. Used by the parent and the workers.
Exercised by: tests/test_cli.py (launch.json) and tests/test_tracking.py.
"""
from __future__ import annotations

import re
from typing import Any

SECRET_NAME = re.compile(r"TOKEN|KEY|PASS|PWD|SECRET|CREDENTIAL|JWT|AUTH|COOKIE", re.IGNORECASE)
URL_CREDENTIALS = re.compile(r"(://)[^/\s]+@")  # user:password@ in a URL
URL_QUERY_SECRET = re.compile(r"([?&][^=&\s]*(?:token|sig|key|secret|pass|auth)[^=&\s]*=)[^&\s]+", re.IGNORECASE)
REDACTED = "<redacted>"


def redact(name: str, value: str) -> str:
    """The value, unless the name says it is a secret; credentials inside URLs are cut out either way."""
    if SECRET_NAME.search(name):
        return REDACTED
    return URL_QUERY_SECRET.sub(rf"\g<1>{REDACTED}", URL_CREDENTIALS.sub(rf"\g<1>{REDACTED}@", value))


def redact_override(override: str) -> str:
    """`key=value` as on the command line, with a secret value redacted."""
    key, sep, value = override.partition("=")
    return f"{key}{sep}{redact(key, value)}" if sep else override


# A config key that names a secret, as a word of its last parts (not `tokenizer`, which names a model).
SECRET_WORD = re.compile(r"(^|[._-])(tokens?|(api_?)?keys?|pass|passwd|passwords?|pwd|secrets?|credentials?|jwt|auth|"
                         r"cookies?)($|[._-])", re.IGNORECASE)
# `export WANDB_API_KEY=...` in a string (launcher.setup lines): the value goes, the name stays.
ASSIGNED_SECRET = re.compile(r"""(\b\w*(?:token|key|pass|pwd|secret|credential|jwt|auth|cookie)\w*\s*=\s*["']?)"""
                             r"""[^\s'"]+""", re.IGNORECASE)


def redacted(name: str, value: Any) -> Any:
    """A config value (nested or not) without secrets: a key that names one (data.api_key, logger.x.token)
    hides its value; credentials inside a URL (user:password@, ?token=) and the value of a secret's
    assignment (export WANDB_API_KEY=...) are cut out of any string."""
    if isinstance(value, dict):
        return {k: redacted(f"{name}.{k}" if name else k, v) for k, v in value.items()}
    if SECRET_WORD.search(name):
        return REDACTED
    if isinstance(value, list):
        return [redacted(name, v) for v in value]
    return ASSIGNED_SECRET.sub(rf"\g<1>{REDACTED}", redact("", value)) if isinstance(value, str) else value
