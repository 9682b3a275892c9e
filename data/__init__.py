"""Task data: the Countdown and math generators, dataset files (data/files.py),
splits and the prompt samplers."""
