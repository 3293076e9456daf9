"""`dllm doctor`: a prepared check of the device path, written as doctor.md and doctor.json.

- correctness.py: tiny random LLaDA and Dream folders (folders.py, fixtures.py) decoded on
  the device under test against the CPU, eager, alone and float32.
- speed.py: random weights at LLaDA-8B's (and Dream-7B's) shape built on the device, timed
  step by step (timing.py).
- run.py: the order, the time budget and the watchdog; report.py: the two files.

Without a CUDA device the same run decodes the CPU halves, times a small stand-in shape and
lists every check it skipped.
"""
