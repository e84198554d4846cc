"""Analysis instruments that no training script imports: run comparison, the metrics glossary, the host-sync counter.

Benchmarks, tests and tools use them to read and measure runs; the training code never depends on them.
"""
