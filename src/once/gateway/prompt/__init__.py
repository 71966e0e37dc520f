"""Items -> prompt ids: the chat template render, full vs incremental ids, tool calls."""
