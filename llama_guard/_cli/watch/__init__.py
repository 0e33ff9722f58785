"""``llama-guard watch``: watch a running llama-server's sockets for stalled connections."""
