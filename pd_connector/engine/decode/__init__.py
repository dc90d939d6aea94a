"""D's side: what the decode instance accepts and pairs (scheduler half), reads (receiver) and from whom (its prefill peers)."""
