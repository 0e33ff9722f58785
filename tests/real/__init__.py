"""Integration tests against a real llama.cpp llama-server (build b11434, see scripts/get_llama_server.py)."""
