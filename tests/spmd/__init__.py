"""SPMD bodies of the parity tests: functions that `multigpu.spmd.run_spmd("spmd.<module>:<function>", n)`
runs on n gloo processes, each returning what the test then judges.

They are test code, not the package's: they live beside the tests, and tests/conftest.py puts
tests/ on the PYTHONPATH of the processes a test starts, so that the workers can import them.
"""
