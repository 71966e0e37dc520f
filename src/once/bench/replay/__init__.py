"""`once replay`: recorded agent sessions through the real stack, and the paid-twice ledger."""
