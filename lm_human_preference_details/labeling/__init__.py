"""Human labels: the labeling web app and its pages, the judgements store, a client, the agreement figures.

Only `label_generation.py` (its `sample`, `serve` and `agreement` commands) and the demo use this room; reward training
reads the label file that `serve` writes, never this code.
"""
