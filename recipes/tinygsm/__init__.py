"""The TinyGSM training recipe: how the shipped weights were made (not part of the package)."""
