"""``llama_guard.metrics``: the guards' counters for Prometheus and OpenTelemetry (each an optional extra)."""
