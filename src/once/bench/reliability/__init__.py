"""`once bench reliability`: the API fuzzed, faults injected, load and sandbox escapes.

Each part is its own module with one entry point returning a flat dict of counts
(fuzz.py, faults.py, load.py, sandbox.py); cli.py runs them and prints one summary.
"""
