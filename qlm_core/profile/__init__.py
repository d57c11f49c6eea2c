"""`qlm profile`: what a parallel layout costs in memory and time, predicted (memory.py, timing.py), measured
(probe.py, measure.py) and searched (search.py). Above train/: it builds the trainer's own Engine to measure."""
