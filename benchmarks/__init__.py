"""The benchmarks: scripts (`python benchmarks/NAME.py` or `python -m benchmarks.NAME`) and the libraries they
share. An installed package, as `training` is, so that `benchmarks.NAME` imports however a script is started."""
