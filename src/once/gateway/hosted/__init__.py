"""Hosted tools: the HostedTool seam (base.py) and the tools the gateway runs itself."""
