"""llama_guard: httpx transports that make pooled clients safe against llama-server."""
