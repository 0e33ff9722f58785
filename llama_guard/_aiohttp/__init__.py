"""The aiohttp flavour of the guard: a client middleware (retries, streams, results) and a connector hook (the
probe of new connections). The public names are in ``llama_guard/aiohttp.py``."""
