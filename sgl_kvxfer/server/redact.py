"""Secrets never leave the server: the launch command as /get_server_info reports it."""
from __future__ import annotations

SECRET_FLAGS = ("--api-key", "--admin-api-key")
REDACTED = "<redacted>"


def redact_command(command: str, secrets: tuple = ()) -> str:
    """`command` with the value of every secret flag replaced (`--api-key K`, `--api-key=K`) and
    every occurrence of a known secret value (argparse also takes abbreviations: `--api-k K`)."""
    for secret in secrets:
        if secret:
            command = command.replace(secret, REDACTED)
    words = command.split(" ")
    out, hide_next = [], False
    for word in words:
        name, eq, _ = word.partition("=")
        if hide_next and word:
            out.append(REDACTED)
            hide_next = False
        elif name in SECRET_FLAGS and eq:
            out.append(f"{name}={REDACTED}")
        else:
            out.append(word)
            hide_next = hide_next or word in SECRET_FLAGS
    return " ".join(out)
