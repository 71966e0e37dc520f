"""The once inference engine. Submodules import torch; this package file does not."""
