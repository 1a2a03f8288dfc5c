"""``fedswarm bench NAME``: benchmarks that compare side by side in one run. The top layer:
it may import every other package. :mod:`.registry` lists them."""
