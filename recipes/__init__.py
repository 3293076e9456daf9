"""Recipes that train the models dllm ships (in the repository, not in the installed package)."""
