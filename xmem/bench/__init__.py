"""The accuracy benchmark's importable parts: reference records, job commands, metrics and the report.

Owns nothing the estimator needs; `scripts/bench_accuracy.py` and `scripts/measure_gpu.py` are its front ends.
"""
