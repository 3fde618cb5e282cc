"""Side-by-side benchmarks. Each `bench/<name>/` is runnable as `python -m bench.<name>`
and prints a Markdown report (figures, ratios, the command, the machine, the date)."""
