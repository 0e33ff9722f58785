"""``llama-guard run -- COMMAND``: start a program with the guard installed in its Python processes.

The program's code is not touched: the guard comes in through ``PYTHONPATH`` (a ``sitecustomize`` that calls
`install()` with the origins in ``LLAMA_GUARD_ORIGINS``), so every Python process the command starts is guarded,
its children included. The command replaces this process (exec), so signals and the exit status are its own.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

from .._install.environment import BOOTSTRAP_DIRECTORY, ORIGINS_VARIABLE, origins_from_text
from .._install.patching import normalise_install_origins

__all__ = ["exec_guarded"]

COMMAND_NOT_FOUND = 127  # the shell's status for a command that cannot be found


def exec_guarded(command: Sequence[str], *, origins: str | None, environ: Mapping[str, str] | None = None) -> int:
    """Exec ``command`` with the guard's environment; returns only on error (status 2, or 127 if not found)."""
    environ = os.environ if environ is None else environ
    command = list(command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print(
            "llama-guard run: give the command to run after --, e.g. llama-guard run -- python app.py", file=sys.stderr
        )
        return 2
    text = origins if origins is not None else environ.get(ORIGINS_VARIABLE, "auto")
    try:
        normalise_install_origins(origins_from_text(text))
    except ValueError as exc:
        given = "--origins" if origins is not None else f"${ORIGINS_VARIABLE}"  # the user's own words, not ours
        print(f"llama-guard run: bad {given} {text!r}: {exc}", file=sys.stderr)
        return 2
    env = dict(environ)
    env[ORIGINS_VARIABLE] = text
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = BOOTSTRAP_DIRECTORY if not path else BOOTSTRAP_DIRECTORY + os.pathsep + path
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command[0], command, env)
    except FileNotFoundError:
        print(f"llama-guard run: command not found: {command[0]}", file=sys.stderr)
        return COMMAND_NOT_FOUND
    except OSError as exc:
        print(f"llama-guard run: cannot run {command[0]}: {exc.strerror}", file=sys.stderr)
        return COMMAND_NOT_FOUND - 1  # 126: found but not executable, as the shell says
    raise AssertionError("unreachable: exec returned")  # pragma: no cover
