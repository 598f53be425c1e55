"""Secrets out of every record the launcher writes or sends (launch.json, tracker params and tags, error
lines): a value whose name says it is secret, and credentials inside URLs. Used by the parent and the workers.
Exercised by: tests/test_cli.py (launch.json) and tests/test_tracking.py.
"""
from __future__ import annotations

import re

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
