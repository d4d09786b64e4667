"""Benchmarks behind ``edgemesh bench ...``: each writes a JSON report and a PNG plot.

Reports default to ``bench/reports/`` of the working directory. Benchmarks compare ratios
measured in one run (this class of machine is noisy); tests never assert their speed.
"""
