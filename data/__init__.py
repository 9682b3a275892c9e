"""Task data: Countdown and math generators, a JSONL loader, and the prompt samplers."""
