"""``llama-guard doctor``: is a llama-server affected by the two defects, and what to do."""
