"""Helpers shared by the test suite and the benchmarks (real server and router processes)."""
