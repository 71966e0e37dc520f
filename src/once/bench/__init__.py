"""Instruments: trace loaders, replay, benchmarks."""
