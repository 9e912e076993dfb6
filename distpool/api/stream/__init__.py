"""What goes back: each choice's tokens detokenized and stop-matched, as SSE chunks or one whole reply."""
