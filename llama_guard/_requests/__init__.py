"""The requests/urllib3 flavour of the guard: a driver of urllib3's connection pools on the shared core."""
