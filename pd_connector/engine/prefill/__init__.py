"""P's side: what the prefill instance hands over (scheduler half) and serves (sender)."""
