"""The guard's decisions and values, free of I/O and of any HTTP library (no httpx, no httpcore)."""
