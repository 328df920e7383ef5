"""tools: the taperay command line and the benchmark harness."""
