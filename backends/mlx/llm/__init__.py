"""LLM pieces: the on-device sampling head and its host reference."""
