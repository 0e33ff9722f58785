"""python -m llama_guard: the llama-guard command."""

import sys

from ._cli.main import main

sys.exit(main())
