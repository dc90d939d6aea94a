"""Everything that reads vLLM's objects into plain values: a vLLM upgrade touches this folder."""
