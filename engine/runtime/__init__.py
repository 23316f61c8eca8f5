"""Generation at run time: picking tokens from logits and cutting the streamed text at stop strings."""
