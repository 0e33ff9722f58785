"""Imported by Python at start-up in processes launched by ``llama-guard run`` (this directory is on PYTHONPATH).

Installs the guard from ``LLAMA_GUARD_ORIGINS``, then runs the ``sitecustomize`` module this one shadows, if the
environment has one, so that a site's own start-up code still runs.
"""

import importlib.machinery
import importlib.util
import os
import sys


def _install() -> None:
    try:
        from llama_guard._install.environment import install_from_environment

        install_from_environment()
    except ImportError as exc:
        # This Python cannot import llama_guard (another interpreter or virtual environment): say so, run anyway.
        sys.stderr.write(f"llama-guard run: the guard is not active in {sys.executable}: {exc}\n")
    except ValueError as exc:
        # Refuse to run unguarded on a typo. SystemExit is not an option here: Python reports exceptions raised
        # by sitecustomize with a traceback and then exits 1.
        sys.stderr.write(f"llama-guard run: {exc}\n")
        sys.stderr.flush()
        os._exit(2)


def _chain_to_shadowed_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    path = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_install()
_chain_to_shadowed_sitecustomize()
