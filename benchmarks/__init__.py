"""The benchmarks: scripts run from the checkout's root as `python -m benchmarks.NAME`, and the libraries they share.
Not installed by the wheel (a user's environment gets only `hf_linear_attn`); the tests find it on pytest's
`pythonpath`."""
