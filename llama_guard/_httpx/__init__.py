"""The httpx flavour: the transports (async source, sync generated), connection hooks, attempt bodies, error
mapping, and `internals` (every private httpcore/httpx access). ``llama_guard/_httpx2`` is generated from here."""
