"""Input classifiers: rules and the embedding classifier, and their exemplars."""
