"""The built-in TinyGSM model's files (data only): weights/ and the frozen held-out sets in heldout/.

How they were made: recipes/tinygsm/ in the repository (not installed).
"""
