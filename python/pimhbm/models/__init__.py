"""Models trained under protection by the tools, tests and benchmarks."""
