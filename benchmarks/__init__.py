"""The benchmarks, run from the repository root as `python -m benchmarks.NAME` (`make bench`,
`make bench-scale`, ...). What each measures and its figures: benchmarks/RESULTS.md."""
