"""Before a response starts: API keys per tenant, rate limits, the CPU cost meter."""
